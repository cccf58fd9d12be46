"""Engine options are declared (raytool.engines.EngineOptions): a misspelled one is an error where it
is written, and each engine gets the ones it takes, its own defaults kept for those left unset."""

import pytest

from raytool.engines import EngineOptions, make_engine


def test_a_misspelled_engine_option_is_an_error_not_dropped(tiny_model_path):
    with pytest.raises(TypeError, match="dela_s"):
        EngineOptions(dela_s=0.0)
    from raytool.engines.scripted import ScriptedEngine

    with pytest.raises(TypeError, match="dtype"):
        ScriptedEngine(tiny_model_path, dtype="float32")  # an engine takes no option it has no use for


def test_each_engine_takes_the_options_it_has_and_keeps_its_defaults(tiny_model_path):
    scripted = make_engine("scripted", tiny_model_path, EngineOptions(dtype="bfloat16", enforce_eager=True, delay_s=0.25))
    assert scripted.delay_s == 0.25  # vLLM's and HF's options are not the scripted engine's
    assert make_engine("scripted", tiny_model_path).delay_s == 0.5  # its own default, none given
    with pytest.raises(ValueError, match="unknown rollout engine 'vlm'"):
        make_engine("vlm", tiny_model_path, EngineOptions())
