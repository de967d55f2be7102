"""How completions get their rewards: the scorer interface and stage, reward-function workers and their
restarts, the teacher, the judge and the reward model."""
