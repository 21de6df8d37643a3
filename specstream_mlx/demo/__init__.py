"""The bundled demo models: how they are built (:mod:`.build`, with the data
generators :mod:`.datagen`, the tokenizers :mod:`.byte_tokenizer` and PyTorch
pretraining :mod:`.torch_pretrain`) and ``make demo`` (:mod:`.run`). The
runtime never imports this package."""
