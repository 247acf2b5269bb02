"""The reward manager grades a mixed batch (puzzles, math records, code records) with the real
verifiers and the sandbox, in input order; ungradable records fail naming their source; a run
can train on prompt records from files."""

import json

import numpy as np
import pytest

from rl.data.entries import load_entries
from rl.rewards import manager, puzzles


def test_mixed_batch_is_graded_by_kind_in_order():
  puzzle = puzzles.make("arithmetic", size=1, seed=3, difficulty=1)[0]
  math_record = {"prompt": "What is 2^10?", "answer": "1024", "domain": "math",
                 "data_source": "toy"}
  code_record = {"prompt": "Double the input.", "domain": "code", "data_source": "toy",
                 "tests": [{"input": "3\n", "output": "6\n"}, {"stdin": "5", "output": "10"}]}
  assert_record = {"prompt": "Write double(x).", "domain": "code",
                   "tests": ["assert double(4) == 8"]}
  entries = [puzzle, math_record, code_record, math_record, code_record, puzzle, assert_record]
  responses = [
      puzzle["solution"],
      "so the result is \\boxed{1024}",
      "```python\nprint(int(input()) * 2)\n```",
      "Answer: 1000",
      "print(int(input()) + 2)",  # 3 + 2 = 5: wrong on the stdio case
      "Answer: 0",
      "def double(x):\n  return 2 * x\n",
  ]
  acc = manager.score_responses(entries, responses)
  np.testing.assert_array_equal(acc, [1, 1, 1, 0, 0, float(puzzle["answer"] == "0"), 1])


def test_training_and_evaluation_read_the_same_program():
  """One extractor: a code response is the same program to the training reward and to the
  evaluation, fenced with a tag, or cut at the length cap before its closing fence."""
  from rl.jobs import evaluation
  from rl.rewards import code as code_reward
  record = {"prompt": "Double the input.", "domain": "code",
            "tests": [{"input": "3\n", "output": "6\n"}]}
  humaneval = evaluation.Problem(id="h", kind="code", question="def f():\n", gold=(
      code_reward.CodeProblem(tests=(code_reward.AssertTest("pass"),), prefix="def f():\n")))
  program = "print(int(input()) * 2)\n"
  for response in [f"```python\n{program}```", f"Here:\n``` py\n{program}",
                   f"```\n{program}```\nDone.", program]:
    assert manager.program_of(humaneval.record("chat"), response) == "\n" + program, response
    assert manager.program_of(record, response) == program, response
    assert manager.score_responses([record], [response])[0] == 1.0, response


@pytest.mark.parametrize("record,message", [
    ({"prompt": "p", "domain": "math", "data_source": "src_a"}, "src_a"),
    ({"prompt": "p", "domain": "code", "data_source": "src_b"}, "without tests"),
    ({"prompt": "p", "domain": "general", "data_source": "src_c"}, "'general'"),
    ({"prompt": "p", "domain": "code", "tests": [{"input": "1"}]}, "needs input and output"),
])
def test_ungradable_records_name_the_culprit(record, message):
  with pytest.raises(ValueError, match=message):
    manager.score_responses([record], ["Answer: 1"])


def test_files_source_loads_records_and_drops_heldout_overlap(tmp_path):
  from configs import demo
  import ml_collections
  train = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
  heldout = [{"problem": "What is 2 + 2?", "answer": "4"},  # also a training prompt: dropped
             {"problem": "What is 7 * 6?", "answer": "42"}]
  for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = ml_collections.ConfigDict(demo.get_config().to_dict())
  c.data.source = "files"
  c.data.train_files = str(tmp_path / "train.jsonl")
  c.data.heldout_files = str(tmp_path / "heldout.jsonl")
  entries, held = load_entries(c)
  assert [e["prompt"] for e in entries][:2] == ["What is 0 + 0?", "What is 1 + 1?"]
  assert [e["prompt"] for e in held] == ["What is 7 * 6?"]
  assert manager.score_responses(held, ["\\boxed{42}"]).tolist() == [1.0]
  (tmp_path / "bad.jsonl").write_text('{"question": "ok", "answer": "1"}\n{"answer": "2"}\n')
  c.data.train_files = str(tmp_path / "bad.jsonl")
  with pytest.raises(ValueError, match="bad.jsonl:2"):
    load_entries(c)
  c.data.skip_bad_records = True
  assert len(load_entries(c)[0]) == 1
