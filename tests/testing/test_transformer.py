"""The tiny transformer test model (``tfuture.testing.transformer``) depends on the whole
sequence, so overlap tests with it exercise real context, not just the last token."""

import numpy as np

from tfuture.testing import RequestSpec, TinyTransformer, run_workload


def test_transformer_reads_the_whole_sequence():
    # Same last token and position, different earlier prompt: a context-free model would agree.
    a = RequestSpec(0, 0, np.array([5, 9, 9, 7]), 6)
    b = RequestSpec(0, 0, np.array([6, 9, 9, 7]), 6)
    outs = [
        run_workload(TinyTransformer(64, max_requests=2, max_len=16), [s], overlap=True, eos=-1)[0]
        for s in (a, b)
    ]
    assert outs[0][0] != outs[1][0]
