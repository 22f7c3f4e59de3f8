"""SamplingParams validation names the bad field; Request lengths are derived."""

import pytest

from rayinfer.engine.types import Request, SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="10"), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_defaults_and_normalisation():
    p = SamplingParams(stop="END", top_k=-1)
    assert p.stop == ["END"] and p.top_k == 0 and not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_request_derived_lengths():
    r = Request("r", [1, 2, 3], SamplingParams())
    r.output_token_ids += [7, 8]
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 2, 5)
    assert r.all_token_ids == [1, 2, 3, 7, 8]


def test_known_token_ids_is_a_slice_of_all_token_ids():
    r = Request("r", [1, 2, 3], SamplingParams())
    r.output_token_ids += [7, 8]
    for start in range(6):
        for end in range(start, 8):
            assert r.known_token_ids(start, end) == r.all_token_ids[start:end]

