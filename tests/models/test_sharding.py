"""Meshes from configs (in-slice and DCN sizes), the replicated-parameter check and
parameters born sharded (models/sharding.py) on 8 CPU devices."""

import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import PartitionSpec as P

from models import sharding as sharding_lib
from models.transformer import build


def _ids(mesh):
  return np.vectorize(lambda d: d.id)(mesh.devices)


def test_make_mesh_lays_devices_out_row_major():
  """make_mesh({"fsdp": 2, "tensor": 4}) puts devices 0..7 in row-major (fsdp, tensor) order,
  unnamed axes have size 1, rows split over the batch axes and a sequence is never split."""
  mesh = sharding_lib.make_mesh({"fsdp": 2, "tensor": 4})
  assert mesh.axis_names == sharding_lib.MESH_AXES
  assert dict(mesh.shape)["expert"] == 1
  np.testing.assert_array_equal(_ids(mesh).reshape(2, 4), np.arange(8).reshape(2, 4))
  assert sharding_lib.logical_to_spec(("batch", "length"), (8, 16), mesh) == P("fsdp", None)
  with pytest.raises(ValueError, match="mesh axes \\['sequence'\\] unknown"):
    sharding_lib.make_mesh({"data": 2, "sequence": 4})


def test_mesh_from_config_lays_out_dcn_like_the_hybrid_mesh():
  """In-slice sizes times DCN sizes give the axis sizes, with each DCN factor outermost: the
  CPU layout equals jax's create_hybrid_device_mesh on devices that carry a slice_index."""
  cfg = {"fsdp": -1, "tensor": 2, "dcn": {"data": 2}}
  mesh = sharding_lib.mesh_from_config(cfg)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
  assert sorted(_ids(mesh)[0].ravel()) == [0, 1, 2, 3]  # slice 0 = the first 4 devices

  ici = [1, 2, 1, 2]
  dcn = [1, 1, 2, 1]  # expert parallel across slices
  mesh = sharding_lib.mesh_from_config({"fsdp": 2, "tensor": 2, "dcn": {"expert": 2}})
  fakes = [types.SimpleNamespace(id=i, slice_index=i // 4, platform="cpu", device_kind="cpu",
                                 process_index=0) for i in range(8)]
  hybrid = mesh_utils.create_hybrid_device_mesh(ici, dcn, fakes)
  np.testing.assert_array_equal(_ids(mesh), np.vectorize(lambda d: d.id)(hybrid))


def test_mesh_config_errors_name_the_problem():
  """Unknown axes (in-slice or DCN), DCN sizes that do not divide the devices and sizes that
  do not multiply out are refused with the offending values."""
  with pytest.raises(ValueError, match="mesh axes \\['pipeline'\\] unknown"):
    sharding_lib.mesh_from_config({"pipeline": 2})
  with pytest.raises(ValueError, match="mesh.dcn axes \\['model'\\] unknown"):
    sharding_lib.mesh_from_config({"data": -1, "dcn": {"model": 2}})
  with pytest.raises(ValueError, match="do not split into 3 slices"):
    sharding_lib.mesh_from_config({"data": -1, "dcn": {"data": 3}})
  with pytest.raises(ValueError, match=r"2 slices\) \{'fsdp': 3\} needs 3 devices, have 4"):
    sharding_lib.mesh_from_config({"fsdp": 3, "dcn": {"data": 2}})


def test_logical_axis_rules_from_the_config():
  """config.mesh.rules replace the parameter axes' rules and nothing else; a bad rule is
  refused naming the field."""
  rules = dict(sharding_lib.make_rules({"embed": "fsdp,data", "heads": ""}))
  assert rules["embed"] == ("fsdp", "data") and rules["heads"] == ()
  assert {k: v for k, v in rules.items() if k not in ("embed", "heads")} == {
      k: v for k, v in sharding_lib.DEFAULT_RULES if k not in ("embed", "heads")}
  with pytest.raises(ValueError, match=r"config.mesh.rules.batch='data': not a parameter axis"):
    sharding_lib.make_rules({"batch": "data"})
  with pytest.raises(ValueError, match=r"config.mesh.rules.mlp='tensr': must name distinct"):
    sharding_lib.make_rules({"mlp": "tensr"})
  with pytest.raises(ValueError, match=r"config.mesh.rules.mlp='tensor,tensor'"):
    sharding_lib.make_rules({"mlp": "tensor,tensor"})


def test_shard_model_init_creates_sharded_parameters():
  """shard_model_init gives every parameter the sharding its logical axes ask for on an
  expert4 x fsdp2 mesh, with the values of the unsharded build (same seed), and the result
  passes the replicated-parameter check."""
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  model = sharding_lib.shard_model_init("tiny_moe_mla_dsa", mesh, seed=3)
  state = nnx.state(model)
  want = sharding_lib.state_shardings(state, mesh)
  for (path, var), (_, sharding) in zip(state.flat_state(), want.flat_state()):
    assert var.get_value().sharding == sharding, path
  reference = dict(nnx.state(build("tiny_moe_mla_dsa", seed=3)).flat_state())
  for path, var in state.flat_state():
    np.testing.assert_allclose(np.asarray(var.get_value()),
                               np.asarray(reference[path].get_value()), rtol=1e-6, atol=1e-9)
  w_gate = model.stacks[1].mlp.w_gate.get_value()  # the MoE layers' [layers, E, D, F]
  assert w_gate.sharding.spec == P(None, "expert", "fsdp", None)
  sharding_lib.check_not_replicated(state, want, min_bytes=32 << 10)


def test_check_not_replicated_names_the_parameters():
  """Big parameters left replicated on a multi-device mesh fail with their paths; a
  one-device mesh and parameters under the size threshold pass."""
  abstract = nnx.state(nnx.eval_shape(lambda: build("tiny_moe_mla_dsa")))
  replicated = sharding_lib.state_shardings(abstract, sharding_lib.make_mesh({"data": 8}))
  with pytest.raises(ValueError, match=r"embed/embedding \(264, 64\).*head/kernel"):
    sharding_lib.check_not_replicated(abstract, replicated, min_bytes=64 << 10)
  sharding_lib.check_not_replicated(abstract, replicated, min_bytes=1 << 20)
  one = sharding_lib.make_mesh({"data": 1}, jax.devices()[:1])
  sharding_lib.check_not_replicated(abstract, sharding_lib.state_shardings(abstract, one), 0)
