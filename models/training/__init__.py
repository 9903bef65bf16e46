"""The bundled model's training: data, tokenizer, training recipe and model card. Never imported by the
engine at run time (tests/test_architecture.py checks it); `completiond train-default` and the training
commands use it."""
