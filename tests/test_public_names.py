"""The names README shows are importable where it shows them: `from hf_accum import AccumulationMixin` (lazily:
`import hf_accum` still loads no torch), and `AccumRewardTrainer` / `AccumRewardConfig` beside the SFT and DPO pairs,
exact against a float64 per-pair reference through an out-of-memory error."""

import subprocess
import sys

import pytest


def test_the_mixin_is_a_top_level_name_and_import_stays_lazy():
    import hf_accum
    from hf_accum import AccumulationMixin
    from hf_accum.trainer import AccumulationMixin as defined

    assert AccumulationMixin is defined and "AccumulationMixin" in hf_accum.__all__ and "AccumulationMixin" in dir(hf_accum)
    probe = "import sys, hf_accum; hf_accum.__all__; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reward_pair_sits_beside_sft_and_dpo(tmp_path):
    trl = pytest.importorskip("trl")
    from hf_accum import AccumTrainingArguments, AccumulationMixin
    from hf_accum.trl import AccumRewardConfig, AccumRewardTrainer

    assert issubclass(AccumRewardTrainer, AccumulationMixin) and issubclass(AccumRewardTrainer, trl.RewardTrainer)
    assert issubclass(AccumRewardConfig, trl.RewardConfig) and issubclass(AccumRewardConfig, AccumTrainingArguments)
    from hf_accum.trl import AccumDPOConfig

    args = AccumRewardConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    dpo = AccumDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    # TRL's gradient_checkpointing=True counts as unset, as in the SFT and DPO configs: the tuner chooses per layer
    assert (args.loss_normalization, args.gradient_checkpointing, args.checkpoint_layers) == (
        "samples", dpo.gradient_checkpointing, dpo.checkpoint_layers)
    assert args.gradient_checkpointing is not True
    with pytest.raises(ValueError, match="loss_normalization='tokens' does not fit RewardTrainer"):
        AccumRewardConfig(output_dir=str(tmp_path), loss_normalization="tokens", use_cpu=True, bf16=False)


def test_accum_reward_trainer_is_exact_through_an_oom(tmp_path, caplog):
    pytest.importorskip("trl")
    from hf_accum.trl import AccumRewardConfig, AccumRewardTrainer
    from tests.integrations.test_trl_mixins import reward_exact

    assert reward_exact(tmp_path, caplog, AccumRewardConfig, AccumRewardTrainer) <= 1e-6
