"""The one tolerance table of the test suite.

Kernels are compared with the float32 torch reference on the *same* inputs (KV already rounded to
its dtype), so the only differences are float32 accumulation order and the vectorised exp:
the same bound serves every KV dtype. The one exception is the CPU kernel's bf16-dot path, which
rounds the probabilities to bf16 as a GPU tensor-core dot does: `cpu_out_tolerance` widens the
output's bound by that rounding's (2^-9 of the largest |V|). Merges of float32 partials are
compared tighter.
"""

import torch

from writescope import ops, reference

ATTENTION_OUT = {"atol": 2e-5, "rtol": 1e-4}
ATTENTION_LSE = {"atol": 2e-5, "rtol": 1e-5}
MERGE = {"atol": 1e-5, "rtol": 1e-5}
COSINE_MIN = 0.9999  # second check on whole outputs


def cpu_out_tolerance(q_dtype, kv_dtype, v):
    """ATTENTION_OUT for the "cpu" backend on these dtypes, widened where its bf16-dot path rounds the
    probabilities to bf16 (`ops.cpu_rounds_probabilities`) by that rounding's bound for the V
    averaged (`reference.probability_rounding_atol`: 2^-9 of its largest |value|)."""
    if not ops.cpu_rounds_probabilities(q_dtype, kv_dtype):
        return ATTENTION_OUT
    return {**ATTENTION_OUT, "atol": ATTENTION_OUT["atol"] + reference.probability_rounding_atol(v)}


def looser(*tolerances):
    """The widest of assert_close tolerances: two backends compared with each other, each off the
    reference by its own."""
    return {key: max(t[key] for t in tolerances) for key in ("atol", "rtol")}


def assert_partials_close(out, lse, ref_out, ref_lse, tol_out=ATTENTION_OUT, tol_lse=ATTENTION_LSE):
    torch.testing.assert_close(out, ref_out, **tol_out)
    torch.testing.assert_close(lse, ref_lse, **tol_lse)  # -inf == -inf is equal here
    if ref_out.numel() and ref_out.abs().sum() > 0:
        cosine = torch.nn.functional.cosine_similarity(out.flatten(), ref_out.flatten(), dim=0)
        assert cosine > COSINE_MIN, f"cosine similarity {cosine:.6f} <= {COSINE_MIN}"

# Compiled Triton on a GPU feeds bf16/fp16 K, V and probabilities to tensor-core dots (float32
# accumulation): the error is that of rounding q and p to the KV dtype.
LOW_PRECISION_DOT = {
    torch.bfloat16: ({"atol": 1e-2, "rtol": 1e-2}, {"atol": 1e-2, "rtol": 1e-3}),
    torch.float16: ({"atol": 2e-3, "rtol": 2e-3}, {"atol": 2e-3, "rtol": 1e-3}),
}


def triton_tolerances(device, kv_dtype):
    """(out, lse) tolerances of the Triton kernels: exact float32 math under the interpreter and for
    float32 KV, low-precision dots when compiled for a GPU."""
    if device == "cpu" or kv_dtype == torch.float32:
        return ATTENTION_OUT, ATTENTION_LSE
    return LOW_PRECISION_DOT[kv_dtype]
