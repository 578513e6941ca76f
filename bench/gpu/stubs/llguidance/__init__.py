"""Stand-in for ``llguidance`` on the GPU machine, used only when the real package is absent.

vLLM 0.26 needs ``llguidance>=1.7,<1.8`` (guided decoding), and evaluates ``llguidance.LLMatcher``
/ ``LLTokenizer`` in annotations when its engine module is imported; the package index the
wheelhouse is built from has no 1.7 release. Nothing here decodes with a grammar, so these
names only have to exist: using any of them raises.
"""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise ImportError("llguidance is not installed on this machine: guided decoding is unavailable")


class LLMatcher(_Unavailable):
    pass


class LLTokenizer(_Unavailable):
    pass


class StructTag(_Unavailable):
    pass


def grammar_from(*args, **kwargs):
    raise ImportError("llguidance is not installed on this machine: guided decoding is unavailable")
