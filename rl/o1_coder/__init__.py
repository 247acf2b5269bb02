"""O1-Coder: MCTS reasoning-data synthesis (mcts, reasoning), the process reward model (prm),
the test-case generator (tcg), and self-play RL on the aggregated reward (selfplay)."""
