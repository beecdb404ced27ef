"""Stand-in for ``TransformerConfig``: takes any keyword (its field list was not read; not checked) and keeps them;
the defaults are those the stand-in modules read."""


class TransformerConfig:
    def __init__(self, **fields):
        self.use_bias = False
        self.gpt_model_use_experimental_version = False
        self.activation_func_clamp_value = None
        self.__dict__.update(fields)
