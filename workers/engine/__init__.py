"""The engine loop: sequences, the block manager, the scheduler, the model runner, sampling."""
