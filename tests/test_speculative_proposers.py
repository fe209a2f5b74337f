"""Prompt lookup (the `ngram` proposer) as a host function over token lists, against a plain reference on random
lists; its rules case by case (no match, the longest suffix first, the most recent of several matches, k and the
end of the list limiting what it proposes); and the `speculative=` option's checks (speculative/options.py)."""

import numpy as np
import pytest
import torch

from helpers import moe_config, tiny_config
from metrale_graph import HybridModel
from metrale_graph.speculative import Speculative, check_speculative, from_vllm, ngram_propose


def reference(tokens, k, low=2, high=4):
    """Prompt lookup as the rule reads, one n and one start at a time."""
    for n in range(high, low - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("case", [
    pytest.param(([1, 2, 3, 4, 5], 3, []), id="no-match"),
    pytest.param(([], 3, []), id="empty"),
    pytest.param(([7], 3, []), id="one-token"),
    pytest.param(([7, 7], 3, []), id="shorter-than-an-earlier-pair"),
    pytest.param(([1, 2, 9, 9, 1, 2], 3, [9, 9, 1]), id="pair"),
    pytest.param(([1, 2, 5, 0, 2, 6, 0, 1, 2], 2, [5, 0]), id="k-limits"),
    pytest.param(([1, 2, 3, 8, 1, 2, 3, 4, 9, 2, 3], 5, [4, 9, 2, 3]), id="most-recent-of-two"),
    pytest.param(([4, 1, 2, 3, 7, 5, 2, 3, 6, 4, 1, 2, 3], 2, [7, 5]), id="longest-suffix-first"),
    pytest.param(([5, 5, 5, 5], 3, [5]), id="overlapping-runs-to-the-end"),
    pytest.param(([3, 1, 2, 3, 1, 2], 10, [3, 1, 2]), id="the-list-ends-first"),
])
def test_prompt_lookup_cases(case):
    tokens, k, want = case
    assert ngram_propose(tokens, k) == want == reference(tokens, k)
    assert ngram_propose(np.array(tokens, dtype=np.int64), k) == want
    assert ngram_propose(torch.tensor(tokens, dtype=torch.int64), k) == want


def test_prompt_lookup_against_the_reference_on_random_lists():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        tokens = torch.randint(0, 1 + trial % 6, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        k = 1 + trial % 5
        low, high = (2, 4) if trial % 3 else (1, 3)
        assert ngram_propose(tokens, k, low, high) == reference(tokens, k, low, high), (tokens, k, low, high)


def test_token_history_follows_a_growing_output():
    """The engine's per-request lookup array (proposers.TokenHistory): prompt then output, appended as the output
    grows (across its capacity), rebuilt if the output were ever shorter than what it saw; lookup over it is
    lookup over the list."""
    from metrale_graph.speculative.proposers import TokenHistory

    h, prompt, out = TokenHistory(), list(range(50)), []
    for t in range(300):
        out += [t % 7] * (1 + t % 3)  # a step may add several tokens (accepted drafts)
        view = h.view(prompt, out)
        assert view.tolist() == prompt + out
        assert ngram_propose(view, 3) == reference(prompt + out, 3)
    assert h.view(prompt, out[:5]).tolist() == prompt + out[:5]


def test_prompt_lookup_arguments_are_checked():
    with pytest.raises(ValueError, match="k .* must be an integer >= 1, got 0"):
        ngram_propose([1, 2, 1, 2], 0)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n, got 3 and 2"):
        ngram_propose([1, 2, 1, 2], 2, min_n=3, max_n=2)


@pytest.fixture(scope="module")
def models():
    return HybridModel.from_preset(tiny_config(mtp_num_hidden_layers=1)), HybridModel.from_preset(tiny_config())


def test_the_speculative_option(models):
    with_head, without = models
    assert check_speculative(None, without) is None
    assert check_speculative("ngram", without) == Speculative("ngram", 3)
    assert check_speculative("mtp", with_head) == Speculative("mtp", 1)
    assert check_speculative({"method": "mtp", "num_tokens": 4}, with_head) == Speculative("mtp", 4)
    assert check_speculative({"method": "ngram", "num_tokens": np.int64(2)}, without) == Speculative("ngram", 2)
    assert check_speculative({"method": "ngram", "max_streams": 4, "prompt_lookup_max": 1}, without) == Speculative(
        "ngram", 3, 4, 1, 1)  # one suffix length given: the other's default moves to it
    assert check_speculative({"method": "ngram", "prompt_lookup_min": 5}, without) == Speculative("ngram", 3, 16, 5, 5)
    # a Speculative is taken (checked again), and a None value means the default, as in from_vllm
    assert check_speculative(Speculative("mtp", 2, 8), with_head) == Speculative("mtp", 2, 8)
    assert check_speculative(Speculative("ngram", 2, 4, 1, 3), without) == Speculative("ngram", 2, 4, 1, 3)
    assert check_speculative({"method": "ngram", "max_streams": None, "num_tokens": None}, without) == Speculative(
        "ngram", 3)


def test_vllm_speculative_config_maps_onto_the_option():
    assert from_vllm({"method": "mtp", "num_speculative_tokens": 3}) == {"method": "mtp", "num_tokens": 3}
    assert from_vllm({"method": "qwen3_next_mtp", "disable_by_batch_size": 8, "num_speculative_tokens": None}) == {
        "method": "mtp", "max_streams": 8}  # null: vLLM's "not given"
    assert from_vllm({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                      "max_streams": 2}) == {"method": "ngram", "num_tokens": 4, "prompt_lookup_min": 2,
                                             "prompt_lookup_max": 5, "max_streams": 2}
    for config, match in [({"method": "mtp", "model": "x", "draft_tensor_parallel_size": 1},
                           r"unknown key\(s\) 'model', 'draft_tensor_parallel_size'; the keys taken are 'method', "
                           "'num_speculative_tokens'"),
                          ({"num_speculative_tokens": 2}, "a 'method' is needed"),
                          ({"method": "eagle3"}, "unknown method 'eagle3'; expected one of 'mtp', 'qwen3_next_mtp'"),
                          ({"method": "mtp", "num_tokens": 2, "num_speculative_tokens": 2},
                           "'num_tokens' and 'num_speculative_tokens' name the same setting"),
                          ([1, 2], "expected a JSON object")]:
        with pytest.raises(ValueError, match=match):
            from_vllm(config)


@pytest.mark.parametrize("option, match", [
    ("eagle", "unknown speculative method 'eagle'; expected one of 'mtp', 'ngram'"),
    ({"num_tokens": 2}, "speculative needs a 'method'"),
    ({"method": "ngram", "k": 2}, r"unknown key\(s\) 'k'"),
    ({"method": "ngram", "num_tokens": 0}, "num_tokens .* must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_tokens": 2.5}, "got 2.5"),
    ({"method": "ngram", "num_tokens": True}, "got True"),
    ({"method": "ngram", "num_tokens": "3"}, "got '3'"),
    (3, "speculative must be None, a method name"),
    ({"method": "ngram", "max_streams": 0}, r"max_streams \(the most decode streams .*\) must be an integer >= 1"),
    ({"method": "mtp", "prompt_lookup_max": 3}, "'prompt_lookup_max': prompt lookup's suffix lengths, for method "
                                                "'ngram' only"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, r"prompt_lookup_min \(4\) must be at most"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min .* must be an integer >= 1, got 0"),
    (Speculative("ngram", 0), "num_tokens .* must be an integer >= 1, got 0"),
    (Speculative("eagle", 2), "unknown speculative method 'eagle'"),
    ({"method": None}, "unknown speculative method None"),
    ({"method": ["mtp"]}, r"unknown speculative method \['mtp'\]"),
])
def test_bad_speculative_options_are_named(models, option, match):
    with pytest.raises(ValueError, match=match):
        check_speculative(option, models[0])


def test_mtp_on_a_model_without_a_head_names_what_is_missing(models):
    with pytest.raises(ValueError, match=r"'mtp' needs the model's multi-token-prediction head, and this model has "
                                         r"none: no mtp\.\* weights .*mtp_num_hidden_layers >= 1"):
        check_speculative("mtp", models[1])
    nxt = HybridModel.from_preset(moe_config("qwen3_next"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        check_speculative({"method": "mtp", "num_tokens": 2}, nxt)
    two = HybridModel.from_preset(tiny_config(mtp_num_hidden_layers=2))
    with pytest.raises(ValueError, match="drafts with one MTP layer; this model's head has 2"):
        check_speculative("mtp", two)
