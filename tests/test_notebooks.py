"""The numbers the source notebooks print, reproduced by both frameworks to the printed precision
(half a unit in the last printed place)."""

from __future__ import annotations

import numpy as np
import torch

HALF_ULP_4 = 0.5e-4 + 1e-6  # printed to 4 decimals; 1e-6 for float32 rounding of the value

# Notebook 001 §1: "Your journey starts with one step" as 3-d vectors.
WORDS_001 = [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
             [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
WEIGHTS_001 = [[0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
               [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
               [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
               [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
               [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
               [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896]]
CONTEXT_001 = [[0.4421, 0.5931, 0.5790], [0.4419, 0.6515, 0.5683], [0.4431, 0.6496, 0.5671],
               [0.4304, 0.6298, 0.5510], [0.4671, 0.5910, 0.5266], [0.4177, 0.6503, 0.5645]]

# Notebook 002 §3-§5, second word as the query.
OMEGA_25_002 = 11.1466
OMEGA_2_002 = [8.5808, -7.6597, 3.2558, 1.0395, 11.1466, -0.4800]
WEIGHTS_2_002 = [0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458]
CONTEXT_2_002 = [-1.5993, 0.0156, 1.2670, 0.0032, -0.6460, -1.1407, -0.4908, -1.4632,
                 0.4747, 1.1926, 0.4506, -0.7110, 0.0602, 0.7125, -0.1628, -2.0184,
                 0.3838, -2.1188, -0.8136, -1.5694, 0.7934, -0.2911, -1.3640, -0.2366,
                 -0.9564, -0.5265, 0.0624, 1.7084]


def test_001_simple_self_attention(twin):
    module = twin.lib.SimpleSelfAttention()
    context, weights = module(twin.array(WORDS_001, "float32"), return_weights=True)
    np.testing.assert_allclose(twin.numpy(weights), WEIGHTS_001, rtol=0, atol=HALF_ULP_4)
    np.testing.assert_allclose(twin.numpy(context), CONTEXT_001, rtol=0, atol=HALF_ULP_4)


def _notebook_002_inputs():
    """The embedded sentence and the three weight matrices, drawn as notebook 002 draws them."""
    sentence = "Life is short, eat dessert first"
    vocab = {s: i for i, s in enumerate(sorted(sentence.replace(",", "").split()))}
    ids = torch.tensor([vocab[s] for s in sentence.replace(",", "").split()])
    torch.manual_seed(123)
    embedded = torch.nn.Embedding(6, 16)(ids).detach()  # (6, 16)
    torch.manual_seed(123)
    w_query, w_key, w_value = torch.rand(24, 16), torch.rand(24, 16), torch.rand(28, 16)
    # The notebook computes W x with W (out, in); the neutral layout is x W with W (in, out).
    params = {"W_query": w_query.T.numpy(), "W_key": w_key.T.numpy(), "W_value": w_value.T.numpy()}
    return embedded.numpy(), params


def test_002_self_attention_with_seeded_weights(twin):
    x, params = _notebook_002_inputs()
    module = twin.build("self_attention", {"d_in": 16, "d_k": 24, "d_v": 28}, params)
    q, k, _ = module.project(twin.array(x, "float32"))
    omega_2 = twin.numpy(q)[1] @ twin.numpy(k).T
    # |ω| ~ 10 computed in float32 from 16-term products: 1e-5 for its rounding.
    assert abs(omega_2[4] - OMEGA_25_002) <= 0.5e-4 + 1e-5
    np.testing.assert_allclose(omega_2, OMEGA_2_002, rtol=0, atol=0.5e-4 + 1e-5)
    context, weights = module(twin.array(x, "float32"), return_weights=True)
    np.testing.assert_allclose(twin.numpy(weights)[1], WEIGHTS_2_002, rtol=0, atol=HALF_ULP_4)
    np.testing.assert_allclose(twin.numpy(context)[1], CONTEXT_2_002, rtol=0, atol=HALF_ULP_4)
