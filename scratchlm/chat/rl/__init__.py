"""Reinforcement learning with verifiable rewards on top of a chat run: the objective (`objective`), the
rewards that score replies (`rewards`), the prompts with their answers (`prompts`), and the training stage
that samples replies with the batched decoding engine (`rollouts`) and learns from them (`stage`)."""
