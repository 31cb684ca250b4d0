"""Every sentence of the manual that says "before", "refused" or "says" about a behaviour is checked by a test (issue
59, done-when). The sentences are found by a regex over README.md and docs/*.md (prose, not code blocks; the
changelog is history), one per sentence; each is in CLAIMS with the tests that check it, or in NO_BEHAVIOUR with why
it describes none. A test named there must exist. The few claims no test checked before this index are checked here,
below the index."""

from __future__ import annotations

import ast
import glob
import json
import os
import re
from types import SimpleNamespace

import pytest

from tests.doc_blocks import ROOT

WORDS = re.compile(r"\b(before|refused|refuses|refuse|says|say)\b", re.I)
SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(\[])")


def manual_pages() -> list[str]:
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *(p for p in docs if not p.endswith("changelog.md"))]


def sentences(page: str):
    """The page's prose (fenced blocks left out), paragraph by paragraph, split after . ! ? before a capital."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines, fenced = [], False
        for line in f.read().splitlines():
            if line.strip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                lines.append(line)
    for paragraph in re.split(r"\n\s*\n", "\n".join(lines)):
        yield from SPLIT.split(" ".join(paragraph.split()))


def claims() -> list[tuple[str, str]]:
    return [(page.removeprefix("docs/"), s) for page in manual_pages() for s in sentences(page) if WORDS.search(s)]


T = "tests/"
CK = T + "trainer/test_checkpoints.py::"
RC = T + "recipes/test_recipe_checks.py::"
ME = T + "docs/test_manual_claims_index.py::"
# (page, a phrase of the sentence, the tests that check it)
CLAIMS: list[tuple[str, str, tuple[str, ...]]] = [
    ("bitsandbytes-cpu-packing.md", "**whatever `training` or `requires_grad` say**",
     (T + "compat/test_bitsandbytes_cpu.py::test_bitsandbytes_packs_a_linear4bit_for_good_on_one_eval_forward_where_flagged",)),
    ("bitsandbytes-cpu-packing.md", "in the probe, before the fused loss's eval-mode check",
     (T + "compat/test_bitsandbytes_cpu.py::test_keep_unpacked_turns_the_flag_off_so_eval_forwards_match_training_ones",
      T + "compat/test_bitsandbytes_cpu.py::test_a_model_from_model_init_is_kept_unpacked_too",
      T + "compat/test_bitsandbytes_cpu.py::test_lora_gradients_after_a_probe_equal_those_of_a_model_never_in_eval_mode",
      T + "compat/test_bitsandbytes_cpu.py::test_a_layer_packed_before_is_converted_back_with_bitsandbytes_inverse")),
    ("bitsandbytes-cpu-packing.md", "training is refused with one line",
     (T + "compat/test_bitsandbytes_cpu.py::test_a_bitsandbytes_without_the_flag_is_refused_in_one_line",)),
    ("cli.md", "a refused setting: one line on stderr naming the key or flag and the fix",
     (T + "cli/test_cli.py::test_a_user_error_is_one_line_and_debug_shows_the_traceback",
      T + "recipes/test_recipes.py::test_the_cli_reports_recipe_errors_in_one_line_with_exit_2",
      T + "cli/test_cli_value_errors.py::test_a_wrong_value_is_one_line_exit_2_before_any_heavy_import",
      T + "cli/test_cli_refusals.py::test_a_stopped_cli_run_says_the_cli_command_that_resumes_it")),
    ("development.md", "or says above it why not",
     (T + "docs/test_docs.py::test_every_check_finds_its_block_and_every_skip_mark_a_block",)),
    ("development.md", "only the refused batch-dependent DPO losses",
     (T + "test_trl_swap_suite.py::test_only_batch_dependent_loss_types_are_allowed_regressions",)),
    ("development.md", "whose `__init__.py` says what the wing holds",
     (T + "test_layers.py::test_every_wing_says_what_it_holds",)),
    ("development.md", "says what the plan becomes",
     (T + "planning/test_policy.py::test_smaller", T + "planning/test_growback.py::test_larger_returns_the_plan_before_the_oom")),
    ("development.md", "`check` (refuse at construction, naming what to set)",
     (T + "levers/test_selective_lever.py::test_a_pin_the_model_cannot_take_is_refused_at_construction",
      T + "levers/test_offload_lever.py::test_a_pin_on_cpu_is_refused_at_construction")),
    ("exactness.md", "(in float64) before `backward`", (T + "test_exactness.py::test_gradient_equals_one_big_batch",)),
    ("exactness.md", "moves kept predictions to the CPU before they outgrow the budget",
     (T + "planning/test_eval_batch.py::test_accumulation_steps_keep_predictions_within_the_budget",)),
    ("exactness.md", "whose batches are its own; one line says so",
     (T + "trainer/test_custom_loader.py::test_an_eval_loader_without_dataset_keeps_the_eval_batch_and_the_exact_eval_loss",)),
    ("exactness.md", "the cut is refused with a message, never trained",
     (T + "window/test_units.py::test_a_cut_that_changes_the_count_is_refused",)),
    ("exactness.md", "and refuse the others (`aot`, `aot_unpaired`, `bco_pair`",
     (T + "integrations/test_dpo.py::test_losses_that_are_not_per_pair_means_are_refused",)),
    ("exactness.md", "does not know is refused at `train()`, before any step",
     (T + "window/test_labels.py::test_a_model_whose_loss_skips_an_unknown_label_is_refused_before_training",)),
    ("exactness.md", "A mismatch says why", (T + "trainer/test_accumulation_check.py::test_a_mismatch_says_why",)),
    ("exactness.md", "is refused with a one-line message naming the setting and the fix, before the first optimizer step",
     (T + "test_args.py::test_bad_arguments_say_the_fix",
      T + "trainer/test_refused_before_probe.py::test_a_batch_of_lists_and_a_model_with_no_head_are_refused_in_one_line")),
    ("exactness.md", "before your script loads a model if it builds the arguments first",
     (T + "docs/test_docs_claims.py::test_the_argument_checks_the_manual_lists_fail_when_the_arguments_are_built",)),
    ("exactness.md", "checked when the recipe loads, before any model, tokenizer or data is loaded and without importing",
     (T + "cli/test_cli_value_errors.py::test_a_wrong_value_is_one_line_exit_2_before_any_heavy_import",
      T + "docs/test_text_truths.py::test_a_mistyped_key_is_reported_without_heavy_imports")),
    ("exactness.md", "**At the start of `train()`, before the probe**",
     (T + "trainer/test_refused_before_probe.py::test_a_refused_run_leaves_an_existing_output_dir_as_it_was",
      T + "trainer/test_preflight.py::test_a_target_larger_than_the_training_set_is_refused",
      T + "trainer/test_resume.py::test_output_dir_holding_a_run_with_another_target_is_an_error")),
    ("exactness.md", "A run refused here leaves `output_dir` as it found it",
     (T + "trainer/test_refused_before_probe.py::test_a_refused_run_leaves_an_absent_output_dir_absent",)),
    ("exactness.md", "`train()` refuses before probing or any optimizer step",
     (T + "trainer/test_preflight.py::test_a_target_larger_than_the_training_set_is_refused",
      T + "trainer/test_preflight.py::test_without_the_tuner_too")),
    ("exactness.md", "are refused the same way, naming the row",
     (T + "trainer/test_preflight.py::test_an_empty_training_set_is_refused",
      T + "trainer/test_preflight.py::test_causal_lm_labels_that_do_not_align_with_input_ids_are_refused")),
    ("exactness.md", "model's config can tell is checked before the probe, and a refused run leaves",
     (T + "trainer/test_refused_before_probe.py::test_a_refused_run_leaves_an_existing_output_dir_as_it_was",
      T + "trainer/test_refused_before_probe.py::test_a_refused_run_leaves_an_absent_output_dir_absent")),
    ("exactness.md", "Remove empty examples before training",
     (T + "trainer/test_dropped_settings.py::test_an_empty_example_is_refused_naming_its_row",
      T + "trainer/test_dropped_settings.py::test_an_empty_recipe_row_is_refused_naming_it",
      T + "test_still_a_trainer.py::test_resuming_a_missing_checkpoint_gives_transformers_own_errors")),
    ("grpo.md", "refused: it depends on the cut by definition (use `dapo`)",
     (T + "integrations/test_grpo.py::test_bnpo_is_refused_when_the_config_is_built_naming_dapo",)),
    ("grpo.md", "Not with images (refused)", (ME + "test_the_grpo_entropy_filter_refuses_images",)),
    ("grpo.md", "Refused before training, each with one line naming the fix",
     (T + "integrations/test_grpo.py::test_what_cannot_be_exact_is_refused_by_the_config",)),
    ("grpo.md", "changes nothing before it, so it is cut off",
     (T + "window/test_units.py::test_trim_only_where_padding_provably_takes_no_part",)),
    ("grpo.md", "(every loss type but the refused `bnpo`)",
     (T + "integrations/test_grpo.py::test_one_step_with_uneven_cuts_and_an_oom_equals_one_pass_and_trls_equal_cut",)),
    ("index.md", "exactly as written, or says above it why it does not",
     (T + "docs/test_docs.py::test_every_check_finds_its_block_and_every_skip_mark_a_block",)),
    ("memory.md", "When `import hf_accum` runs before CUDA starts",
     (T + "compat/test_allocator.py::test_importing_hf_accum_sets_it_before_torch_loads",)),
    ("memory.md", "when CUDA started before the import (the log says so)", (T + "compat/test_allocator.py::test_choose",)),
    ("memory.md", "(they agree just before and after each window's final forward",
     (T + "window/test_protocol.py::test_normal_window_makes_four_collectives",
      T + "window/test_protocol.py::test_oom_in_the_final_backward_stops_every_rank")),
    ("memory.md", "returns to the plan it had before the first OOM",
     (T + "planning/test_grow_back_runs.py::test_one_oom_at_step_3_is_back_on_the_probed_plan_after_16_clean_steps",
      T + "planning/test_grow_back_runs.py::test_micro_batches_the_user_set_grow_back_too")),
    ("memory.md", "Before training: the default budget is 0.9",
     (T + "planning/test_tuning.py::test_the_default_budget_is_a_fraction_of_what_this_process_can_use",)),
    ("memory.md", "is refused naming `memory_budget_bytes` and suggesting `memory_budget`",
     (T + "planning/test_tuning.py::test_budget_above_capacity_fails_before_any_step_naming_the_real_arguments",)),
    ("plan.md", "A plan without step times (`auto_tune=False` with `max_tokens_per_forward`",
     (T + "window/test_token_budget.py::test_a_plan_without_step_times_says_once_that_the_padding_rule_cuts",)),
    ("plan.md", "a second tune of an equal model with the same budget and search",
     (T + "probing/test_estimate_seed.py::test_an_estimate_is_made_once_per_process_for_the_same_model_and_settings",)),
    ("plan.md", "Before training, `train()` runs real training steps",
     (T + "planning/test_tuning.py::test_the_probes_step_bounds_a_real_training_step_on_padded_rows",
      T + "planning/test_tuning.py::test_plan_is_measured_applied_and_written")),
    ("plan.md", "the longest sequence they let through, and the run says so in one line",
     (T + "planning/test_probe_batches.py::test_sft_iterable_dataset_is_planned_at_max_length",
      T + "planning/test_probe_batches.py::test_dpo_iterable_dataset_is_planned_at_max_length")),
    ("plan.md", "a causal LM's is refused naming `probe_seq_len`",
     (T + "planning/test_probe_batches.py::test_sft_iterable_dataset_without_a_bound_is_refused",
      T + "planning/test_probe_batches.py::"
          "test_an_iterable_dataset_of_sequences_for_a_model_that_is_no_causal_lm_is_refused_with_a_fix_that_works")),
    ("plan.md", "The plan says what it chose",
     (T + "levers/test_checkpoint_tuning.py::test_auto_measures_both_levels_chooses_verifies_and_applies_k",
      T + "levers/test_checkpoint_tuning.py::test_a_stored_plans_k_is_reapplied_without_a_probe")),
    ("plan.md", "given with `gradient_checkpointing=true` too it is refused",
     (T + "levers/test_checkpoint_tuning.py::test_an_explicit_flag_is_obeyed",
      T + "levers/test_checkpoint_tuning.py::test_an_explicit_k_is_probed_and_trained_at",
      T + "recipes/test_recipes.py::test_checkpoint_layers_with_the_flag_on_the_command_line_too_is_refused",
      T + "test_args.py::test_bad_checkpointing_setting", T + "test_args.py::test_trl_default_checkpointing_counts_as_unset")),
    ("plan.md", "the probe does not choose k (one log line says so",
     (T + "levers/test_checkpoint_tuning.py::test_the_lever_is_skipped_under_a_sharded_engine",)),
    ("plan.md", "Checkpointing asked of a model that cannot is refused when the trainer is built",
     (T + "levers/test_checkpoint_tuning.py::test_checkpointing_asked_of_a_model_that_cannot",)),
    ("plan.md", "the plan line says `checkpointing F full + S selective of L layers`",
     (T + "levers/test_selective_lever.py::test_selective_is_chosen_where_it_is_the_fastest_fit",
      T + "levers/test_selective_lever.py::test_a_budget_only_selective_or_full_fits_trains_without_any_flag")),
    ("plan.md", "on CPU that line says the lever is absent",
     (T + "levers/test_offload_lever.py::test_on_cpu_the_probe_log_says_in_one_line_that_offload_is_absent",
      T + "levers/test_offload_lever.py::test_a_pin_on_cpu_is_refused_at_construction")),
    ("plan.md", "The plan is shown by default, as one short line at warning level",
     (T + "planning/test_tuning.py::test_plan_and_measurements_are_shown_by_default_and_in_the_trainers_logs",
      T + "test_still_a_trainer_target.py::test_log_history_and_events_are_the_trainers_with_the_figures_on_the_first_entry",
      T + "test_still_a_trainer_target.py::"
          "test_a_run_resumed_from_a_checkpoint_saved_before_any_log_entry_has_the_uninterrupted_runs_log_history")),
    ("plan.md", "its key equals the new run's key field for field; one line says so",
     (T + "planning/test_tuning.py::test_stored_plan_is_reused_only_when_the_key_matches",
      T + "cli/test_cli_runs.py::test_probe_recipe_stores_the_plan_that_train_reuses")),
    ("plan.md", "there is no plan file in `output_dir`",
     (T + "docs/test_text_truths.py::test_probe_without_output_dir_says_once_that_nothing_was_stored",
      T + "docs/test_docs_claims.py::test_the_reuse_section_names_every_field_of_the_plan_key",
      T + "planning/test_plan_store.py::test_a_stale_stored_plan_says_which_part_of_its_key_changed",
      T + "planning/test_plan_store.py::test_a_stored_plan_that_cannot_be_trusted_is_named_and_probed_again",
      T + "planning/test_tuning.py::test_ranks_reuse_a_stored_plan_only_when_every_rank_found_the_same")),
    ("plan.md", "The key holds the budget as requested, not the bytes it came to",
     (T + "planning/test_tuning.py::test_the_default_budget_is_a_fraction_of_what_this_process_can_use",)),
    ("plan.md", "without it `--plot` stops before any model work, saying so",
     (T + "docs/test_docs_claims.py::test_plot_without_matplotlib_fails_before_a_model_is_loaded",)),
    ("plan.md", "and says where the budget came from",
     (T + "probing/test_probe_report.py::test_the_default_budget_is_named_in_the_output",
      T + "probing/test_probe_report.py::"
          "test_a_chosen_size_never_measured_is_marked_and_kinds_without_points_have_no_entry",
      T + "cli/test_cli.py::test_probe_default_run_plans_accumulation")),
    ("plan.md", "## A plan before anything loads: `--estimate`",
     (T + "recipes/test_estimate_recipes.py::test_a_recipe_on_a_config_folder_builds_from_the_config_at_max_length",
      T + "probing/test_estimate.py::test_cli_estimate_writes_the_plan_with_every_peak")),
    ("plan.md", "before any weights are downloaded or a GPU is rented",
     (T + "recipes/test_estimate_recipes.py::test_a_recipe_on_a_config_folder_builds_from_the_config_at_max_length",
      T + "probing/test_estimate.py::test_cli_estimate_writes_the_plan_with_every_peak")),
    ("plan.md", "runs the same step on CPU kernels and says what it assumes of the card",
     (T + "probing/test_estimate.py::test_cuda_estimate_on_a_cpu_build_says_its_assumptions",)),
    ("plan.md", "the output says which loss it assumed",
     (T + "levers/test_kernels.py::test_fused_loss_flags_change_the_cli_estimate",
      T + "levers/test_kernels.py::test_the_estimate_of_the_fused_loss_matches_the_probe")),
    ("plan.md", "the cache emptied before each step, as the CUDA meter does",
     (T + "probing/test_estimate_reserved.py::test_reserved_bytes_follow_the_allocator_rules",
      T + "probing/test_estimate_reserved.py::test_the_table_is_what_a_real_card_reserves")),
    ("plan.md", "The output says so in one line (`assumed: reserved bytes modelled",
     (T + "probing/test_estimate_reserved.py::test_the_cuda_estimate_fits_by_reserved_bytes_and_says_so",)),
    ("plan.md", "the trainer's optimizer (AdamW, fused as `optim` says)",
     (T + "recipes/test_estimate_recipes.py::test_overrides_reach_the_keywords",
      T + "recipes/test_estimate_recipes.py::test_each_recipe_on_paper",
      T + "recipes/test_estimate_recipes.py::test_the_length_is_the_one_the_probe_measures")),
    ("plan.md", "GRPO recipes are refused in one line",
     (T + "recipes/test_estimate_recipes.py::test_grpo_is_refused_in_one_line_naming_why",
      T + "recipes/test_estimate_recipes.py::test_cli_refuses_grpo_in_one_line")),
    ("plan.md", "one log line says why and the search starts from micro-batch 1",
     (T + "probing/test_estimate_seed.py::test_a_failing_estimate_says_so_in_one_line_and_searches_as_before",
      T + "probing/test_estimate_seed.py::test_unsupported_reasons")),
    ("plan.md", "the base quantized as its `quantization_config` says",
     (T + "probing/test_estimate_seed.py::test_the_estimate_quantizes_as_the_models_quantization_config",
      T + "probing/test_estimate_seed.py::test_the_rebuilt_model_carries_trls_fused_head_and_the_trainers_dtypes")),
    ("plan.md", "The plan line says what the budget gives on the user's data",
     (T + "window/test_token_budget.py::test_the_tuner_measures_a_token_budget_at_the_longest_and_shortest_example",)),
    ("plan.md", "an example longer than it is refused before training, naming its row",
     (T + "window/test_token_budget.py::test_an_example_longer_than_the_budget_is_refused_naming_it_before_training",)),
    ("plan.md", "is refused before the probe); `fused_loss=False` turns the fused loss off",
     (T + "levers/test_kernels.py::test_a_bad_pin_is_one_line_before_the_probe",
      T + "levers/test_kernels.py::test_forced_kernel_that_cannot_run_is_one_error",
      T + "levers/test_kernels.py::test_fused_loss_false_has_no_kernel")),
    ("plan.md", "`use_liger_kernel=True` without liger-kernel installed is refused when the arguments are built",
     (T + "levers/test_kernels.py::test_use_liger_kernel_without_the_package_is_one_line_at_once",
      T + "levers/test_kernels.py::test_use_liger_kernel_off_cuda_is_one_line_at_once")),
    ("plan.md", "an explicit True is refused",
     (T + "levers/test_kernels.py::test_use_liger_kernel_routes_to_one_loss_path",
      T + "levers/test_kernels.py::test_use_liger_kernel_runs_liger_in_our_fused_loss_exactly_and_names_it")),
    ("plan.md", "the plan line says `loss from the full logits (fused loss off)",
     (T + "levers/test_kernels.py::test_use_liger_kernel_runs_liger_in_our_fused_loss_exactly_and_names_it",)),
    ("plan.md", "its plan line says `loss by TRL's fused LM head",
     (T + "levers/test_kernels.py::test_use_liger_kernel_with_trls_fused_head_is_one_loss_path_named_in_the_plan_line",)),
    ("plan.md", "The probe runs before transformers applies Liger's layer kernels",
     (T + "levers/test_kernels.py::test_use_liger_kernel_runs_liger_in_our_fused_loss_exactly_and_names_it",)),
    ("quickstart.md", "`--plot` stops before any model work with",
     (T + "docs/test_docs_claims.py::test_plot_without_matplotlib_fails_before_a_model_is_loaded",)),
    ("recipes.md", "whose settings still look like the demonstration's says so in one line before training",
     (T + "recipes/test_recipe_real.py::test_a_toy_setting_on_a_users_model_is_said_in_one_line",)),
    ("recipes.md", "a key of another trainer (`beta=` in an SFT recipe) is refused",
     (T + "recipes/test_recipe_dpo.py::test_a_dpo_key_is_refused_for_an_sft_recipe",)),
    ("recipes.md", "asked for without held-out rows, it is refused when the recipe loads",
     (T + "recipes/test_recipe_eval.py::test_bad_eval_settings_are_refused_when_the_recipe_loads",)),
    ("recipes.md", "when the recipe loads, before any model or data work (`--print-config` checks too)",
     (T + "recipes/test_recipes.py::test_the_cli_reports_recipe_errors_in_one_line_with_exit_2",
      T + "recipes/test_recipes.py::test_a_wrong_value_is_refused_when_the_recipe_loads",
      T + "cli/test_cli_value_errors.py::test_a_wrong_value_is_one_line_exit_2_before_any_heavy_import",
      T + "recipes/test_recipes.py::test_a_bad_data_file_is_named_with_its_line",
      T + "cli/test_cli.py::test_an_unreachable_hub_fails_fast_with_the_offline_hint",
      T + "cli/test_cli_refusals.py::test_an_output_dir_root_cannot_create_is_one_line_exit_2")),
    ("recipes.md", "dropped only when `import hf_accum` comes before `import peft`",
     (T + "compat/test_quiet_output.py::test_bitsandbytes_kernel_line_is_dropped_whenever_hf_accum_comes_before_bitsandbytes",)),
    ("scaling.md", "its `Trainer` refuses full checkpoints for one",
     (T + "compat/test_compat.py::test_load_time_sharding_is_read_from_the_model_and_transformers_still_cannot_resume_it",)),
    ("scaling.md", "So `AccumTrainer` refuses `resume_from_checkpoint` for such a model before any work",
     (T + "integrations/test_engines.py::test_a_model_sharded_at_load_runs_on_fsdp_and_cannot_resume",)),
    ("scaling.md", "`resume_from_checkpoint` under load-time FSDP2 is refused before any work",
     (T + "integrations/test_engines.py::test_a_model_sharded_at_load_runs_on_fsdp_and_cannot_resume",
      T + "test_loop.py::test_fsdp2_loop_resumed_from_a_distributed_checkpoint_in_a_new_process_group_ends_equal",
      T + "integrations/test_fsdp2.py::test_an_fsdp_request_that_would_fall_back_is_refused_on_every_rank")),
    ("scaling.md", "An explicit value that contradicts the plan is refused before anything loads",
     (T + "integrations/test_deepspeed.py::test_an_explicit_field_contradicting_the_arguments_plan_is_refused",
      T + "integrations/test_deepspeed.py::test_explicit_batch_fields_must_equal_the_plan")),
    ("scaling.md", "Its engine steps inside backward, before hf_accum could drop",
     (T + "trainer/test_nonfinite.py::"
          "test_under_deepspeed_the_default_is_off_with_one_line_and_only_an_explicit_limit_is_refused",
      T + "trainer/test_nonfinite.py::test_an_explicit_limit_under_deepspeed_is_refused")),
    ("scaling.md", "each measurement the largest before the search reads it (`probing/agreed.py`",
     (T + "probing/test_engine_probe.py::test_a_model_sharded_in_place_is_probed_in_lockstep_on_the_worse_ranks_figures",
      T + "integrations/test_fsdp2.py::test_load_time_fsdp2_matches_ddp_and_the_meter_and_probe_count_local_shards")),
    ("scaling.md", "each measurement is the largest over the ranks before the search reads it",
     (T + "probing/test_engine_probe.py::test_each_rank_searches_the_largest_figures_over_the_ranks",)),
    ("scaling.md", "(refused: set them `\"auto\"`)",
     (T + "integrations/test_deepspeed.py::test_auto_tune_under_deepspeed_refuses_fields_it_chooses",)),
    ("development.md", "the library now refuses a float64 model under ZeRO-3 when the trainer is built",
     (T + "integrations/test_deepspeed.py::test_oom_under_zero3_stops_every_rank_and_use_cpu_false_is_refused",)),
    ("scaling.md", "A float64 model under ZeRO-3 is refused when the trainer is built",
     (T + "integrations/test_deepspeed.py::test_oom_under_zero3_stops_every_rank_and_use_cpu_false_is_refused",)),
    ("scaling.md", "`trainer.tune()` before `train()` is refused under DeepSpeed",
     (T + "integrations/test_deepspeed.py::test_one_process_pieces_and_oom_stop",)),
    ("scaling.md", "stops every rank before the first optimizer step",
     (T + "probing/test_engine_probe.py::test_an_out_of_memory_error_stops_every_rank_with_what_to_set",
      T + "integrations/test_deepspeed.py::test_out_of_memory_in_the_engine_probe_stops_every_rank")),
    ("scaling.md", "the error says so and names the keys instead of advising checkpointing",
     (T + "probing/test_engine_probe.py::test_the_buffer_message_names_the_keys_and_not_checkpointing",
      T + "probing/test_engine_probe.py::test_an_out_of_memory_error_at_micro_batch_one_names_the_buffers_where_they_dominate")),
    ("still-a-trainer.md", "from a checkpoint saved before the first entry (`logging_steps` 500)",
     (T + "test_still_a_trainer_target.py::"
          "test_a_run_resumed_from_a_checkpoint_saved_before_any_log_entry_has_the_uninterrupted_runs_log_history",)),
    ("still-a-trainer.md", "Each is refused (a one-line error naming the fix, before any optimizer step)",
     (T + "test_args.py::test_auto_find_batch_size_is_refused_when_hf_accum_plans_the_batch",
      T + "trainer/test_resume.py::test_resume_with_another_target_is_an_error",
      T + "trainer/test_preflight.py::test_a_target_larger_than_the_training_set_is_refused",
      T + "integrations/test_dpo.py::test_losses_that_are_not_per_pair_means_are_refused",
      T + "integrations/test_grpo.py::test_what_cannot_be_exact_is_refused_by_the_config")),
    ("still-a-trainer.md", "`auto_find_batch_size=True` with a target | refused at construction",
     (T + "test_args.py::test_auto_find_batch_size_is_refused_when_hf_accum_plans_the_batch",
      T + "trainer/test_resume.py::test_resume_with_another_target_is_an_error",
      T + "integrations/test_grpo.py::test_bnpo_is_refused_when_the_config_is_built_naming_dapo",
      T + "trainer/test_preflight.py::test_a_target_larger_than_the_training_set_is_refused",
      T + "trainer/test_nonfinite.py::test_too_many_nan_steps_in_a_row_stop_with_a_checkpoint")),
    ("still-a-trainer.md", "(refused with \"its longest example is unknown; set probe_seq_len\"",
     (T + "planning/test_probe_batches.py::test_sft_iterable_dataset_without_a_bound_is_refused",)),
    ("still-a-trainer.md", "What fails only with ours: the four refused batch-dependent DPO losses",
     (T + "test_trl_swap_suite.py::test_only_batch_dependent_loss_types_are_allowed_regressions",)),
    ("still-a-trainer.md", "(a target larger than the training set, refused)",
     (T + "trainer/test_preflight.py::test_a_target_larger_than_the_training_set_is_refused",)),
    ("scaling.md", "Where the machines share no filesystem, set `save_on_each_node=True`",
     (T + "integrations/test_two_nodes.py::test_two_nodes_agree_on_one_plan_stop_together_resume_from_their_own_folders_and_stay_exact",
      T + "compat/test_compat.py::test_transformers_writes_a_models_files_on_global_rank_0_only_and_node_saving_defers_to_the_trainer")),
    ("stopping.md", "is refused before any model is built, and nothing there changes",
     (T + "cli/test_cli_runs.py::test_a_rerun_with_another_target_changes_nothing_and_is_refused_before_any_model_work",
      RC + "test_an_output_dir_planned_for_another_target_is_refused", RC + "test_resume_values")),
    ("stopping.md", "the stop message says how long they took and warns when it was longer",
     (ME + "test_the_stop_message_says_how_long_the_stop_took_and_warns_past_torchruns_grace",)),
    ("stopping.md", "checkpoints written before stay, nothing more is saved, and `hf-accum train` says so",
     (T + "trainer/test_stop_through_tee.py::test_a_second_ctrl_c_stops_at_once_and_says_so",)),
    ("stopping.md", "the accumulation check before it — the handlers are not installed",
     (T + "cli/test_cli_refusals.py::test_ctrl_c_during_start_up_is_one_line_and_leaves_output_dir_as_it_was",)),
    ("stopping.md", "`hf-accum train` says the command that resumes it",
     (T + "cli/test_cli_refusals.py::test_a_stopped_cli_run_says_the_cli_command_that_resumes_it",
      T + "trainer/test_stop_through_tee.py::test_ctrl_c_with_both_streams_piped_saves_and_exits_as_stopped")),
    ("stopping.md", "transformers writes `trainer_state.json` before the trainer writes the checkpoint's",
     (CK + "test_a_lost_plan_is_refused_with_the_way_out_and_the_way_out_resumes_exactly",)),
    ("stopping.md", "its `training_args.bin` says the run had a `target_batch_size`",
     (CK + "test_a_checkpoint_without_a_readable_plan_is_not_resumed_at_another_target",
      CK + "test_a_corrupt_plan_file_is_named",
      T + "compat/test_compat.py::test_training_args_are_saved_before_trainer_state_and_read_without_unpickling_code")),
    ("stopping.md", "Resuming it by path is refused when `train()` starts, before the probe",
     (CK + "test_a_lost_plan_is_refused_with_the_way_out_and_the_way_out_resumes_exactly",
      CK + "test_a_truncated_checkpoint_given_by_path_names_the_file_and_the_newest_good_one",
      RC + "test_resume_true_with_no_complete_checkpoint_names_the_bad_file_and_a_way_out_that_works",
      ME + "test_a_recipe_refuses_a_bad_checkpoint_by_path_before_the_model_is_built")),
    ("stopping.md", "with none complete it says why for each",
     (CK + "test_true_without_a_complete_checkpoint_says_why",
      RC + "test_resume_true_with_no_complete_checkpoint_names_the_bad_file_and_a_way_out_that_works",
      ME + "test_with_no_complete_checkpoint_a_recipe_says_why_for_each",
      CK + "test_true_skips_a_checkpoint_with_a_truncated_file_and_resumes_exactly")),
    ("stopping.md", "Checkpoints of plain `Trainer` runs (no target, no plan file) resume as before",
     (CK + "test_plain_trainer_checkpoints_stay_resumable",)),
    ("stopping.md", "by path it is refused before the probe or any step",
     (CK + "test_a_save_only_model_checkpoint_is_refused_before_any_training",
      CK + "test_true_over_only_save_only_model_checkpoints_is_refused_naming_each",
      CK + "test_an_explicit_weights_only_checkpoint_points_to_the_older_complete_one")),
    ("stopping.md", "says so instead of advising a resume",
     (CK + "test_a_save_only_model_runs_stop_advice_is_a_new_run_not_a_resume",)),
    ("stopping.md", "The error says \"finite weights\" only after checking them",
     (T + "trainer/test_nonfinite.py::test_weights_an_optimizer_made_non_finite_are_not_called_finite",)),
    ("usage.md", "fails when the arguments are built, before you load a model",
     (T + "docs/test_docs_claims.py::test_the_argument_checks_the_manual_lists_fail_when_the_arguments_are_built",
      T + "trainer/test_refused_before_probe.py::test_a_refused_run_leaves_an_existing_output_dir_as_it_was")),
    ("usage.md", "the trainers whose batches it cannot cut exactly are refused when the class is constructed",
     (T + "integrations/test_trl_mixins.py::test_each_trl_trainer_mixed_in_is_exact_or_refused",
      T + "integrations/test_trl_mixins.py::test_a_trl_trainer_missing_from_the_table_is_refused")),
    ("usage.md", "the others refused", (T + "integrations/test_trl_mixins.py::test_each_trl_trainer_mixed_in_is_exact_or_refused",)),
    ("usage.md", "`fused_loss=False` with a router loss is refused",
     (T + "integrations/test_router_aux.py::test_fused_loss_off_with_a_router_loss_is_refused",)),
    ("what-fits-where.md", "ZeRO is modelled from its config and the output says so",
     (T + "probing/test_estimate_sharded.py::test_the_cli_prints_a_table_per_card_and_refuses_gpus_without_estimate",)),
    ("what-fits-where.md", "the output lists what the estimate assumes of a CUDA card",
     (T + "probing/test_estimate.py::test_cuda_estimate_on_a_cpu_build_says_its_assumptions",
      T + "probing/test_fits.py::test_table_and_json")),
    ("what-fits-where.md", "print the single estimate, as before",
     (T + "probing/test_fits.py::test_one_value_each_keeps_the_single_estimate",)),
    ("what-fits-where.md", "the cache is emptied before the next, so a size measured after others",
     (T + "probing/test_paper_session.py::test_a_size_measured_after_others_measures_what_it_would_first",)),
    ("what-fits-where.md", "(the loss line says which)", (T + "levers/test_kernels.py::test_fused_loss_flags_change_the_cli_estimate",)),
]

# sentences the regex finds that describe no behaviour of hf_accum: (page, phrase, why)
NO_BEHAVIOUR: list[tuple[str, str, str]] = [
    ("README.md", "## The manual - [Quick start]", "the table of contents"),
    ("api.md", "([The plan: `--estimate`](plan.md#a-plan-before-anything-loads-estimate))", "a link's title"),
    ("cli.md", "Which errors come before any model work, and how fast", "a pointer to recipes.md's sentence, indexed"),
    ("development.md", "The tenth session's CI failed one test that had passed in every run before it",
     "what happened to one CI run (before: the runs that had passed), not a behaviour"),
    ("development.md", "and only rank 0 makes it (transformers' `should_save`) and removes it when the trainer is refused",
     "why a test's two ranks saw different folders (the refusal itself is indexed above: the float64 sentence)"),
    ("development.md", "The worker now records what is left after a barrier, once both ranks have refused",
     "how a test worker records its result, not the library's behaviour"),
    ("development.md", "`python scripts/dev/test_census.py tests` counts test functions and assertions",
     "a development practice (figures before and after a change), not the library's behaviour"),
    ("development.md", "Where the CPU goes (py-spy recording every process of a README run",
     "a measurement of where the suite's CPU went (before: the changes it led to), not a behaviour"),
    ("development.md", "A fresh interpreter that imports transformers' Trainer takes about 10 s here",
     "why the suite's time is spent where it is (an interpreter's imports before its first step)"),
    ("development.md", "`trainer/checks/construction.py` holds what the mixin checks and refuses",
     "where code lives (test_layers checks the layout), not what it does"),
    ("exactness.md", "## What is refused, and when", "a heading; the sentences under it are indexed"),
    ("index.md", "| know what \"exact\" means, and what is refused and why |", "the table of contents"),
    ("measured.md", "the wheels carried as `../shared/gpu/README.md` says", "how to run a benchmark"),
    ("plan.md", "beside what the usual tools say for the same model", "benchmarks/bench_estimate.py --compare-8b"),
    ("plan.md", "| tool | what it says for Llama-3-8B |", "benchmarks/bench_estimate.py --compare-8b's table"),
    ("plan.md", "| tokens, padded rows, fewest forwards (before) |", "a benchmark table's row for the old algorithm"),
    ("plan.md", "Before the step-time model (one run, 2 shared cores)", "history: a benchmark before a change"),
    ("recipes.md", "load average 0.01 before", "the conditions of a timing"),
    ("still-a-trainer.md", "This page says how that is checked", "what the page holds"),
    ("still-a-trainer.md", "(iterable datasets, before the data-scan fix)", "history: a run's result before a fix"),
    ("still-a-trainer.md", "Before this change, the MoE tests", "history: what failed before a fix"),
    ("still-a-trainer.md", "each refused by `AccumGRPOTrainer` before (the first two",
     "history: what an earlier version refused"),
    ("what-fits-where.md", "The question before renting a card", "the user's question"),
    ("what-fits-where.md", "see [The plan](plan.md#a-plan-before-anything-loads-estimate)", "a link's title"),
    ("what-fits-where.md", "it does not say which of its terms coexist", "what another tool (accelerate) says"),
]


def _covering(page, sentence):
    return ([c for c in CLAIMS if c[0] == page and c[1] in sentence]
            + [n for n in NO_BEHAVIOUR if n[0] == page and n[1] in sentence])


def test_every_claim_sentence_is_indexed_or_says_why_it_is_no_behaviour():
    found = claims()
    assert len(found) > 100, "the regex finds the manual's sentences"  # a broken split would find few
    missing = [f"{page}: {sentence[:160]}" for page, sentence in found if not _covering(page, sentence)]
    assert not missing, "\n".join(missing)


def test_every_phrase_of_the_index_is_in_one_sentence_of_its_page():
    found = claims()
    for page, phrase, *_ in CLAIMS + NO_BEHAVIOUR:
        hits = [s for p, s in found if p == page and phrase in s]
        assert len(hits) == 1, f"{page}: {phrase!r} in {len(hits)} claim sentences"


def test_every_test_the_index_names_exists():
    """Each node is a test function at the top level of its module. Read from the module's syntax tree, as pytest
    collects it, not by importing it: the modules the index names import DeepSpeed, TRL and the rest (a minute)."""
    defined: dict[str, set[str]] = {}
    for _, _, tests in CLAIMS:
        assert tests
        for node in tests:
            path, name = node.split("::")
            if path not in defined:
                with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                defined[path] = {d.name for d in tree.body if isinstance(d, ast.FunctionDef)}
            assert name.startswith("test_") and name in defined[path], node


# ---- the claims no test checked before ---------------------------------------------------------------------------
def test_the_grpo_entropy_filter_refuses_images():
    """docs/grpo.md: the window-wide entropy filter does not forward images, so a batch with them is refused."""
    import torch

    from hf_accum.integrations.trl.grpo_entropy import with_entropy_masks

    with pytest.raises(ValueError, match=r"^top_entropy_quantile < 1 with images: .* Set top_entropy_quantile=1\.0"):
        with_entropy_masks(None, [{"pixel_values": torch.zeros(1, 3, 2, 2), "completion_ids": torch.zeros(1, 2)}], 1)


@pytest.mark.parametrize("took,late", [(2.0, False), (45.0, True)])
def test_the_stop_message_says_how_long_the_stop_took_and_warns_past_torchruns_grace(tmp_path, took, late):
    """docs/stopping.md: the stop message says how long the step and the checkpoint took after the signal, and warns
    when that was longer than torchrun's 30 s grace period."""
    from hf_accum.trainer.resilience import stopping
    from hf_accum.trainer.resilience.preemption import Preempted

    request = SimpleNamespace(seconds_since=lambda: took, signal_name="SIGTERM", dead_streams=())
    trainer = SimpleNamespace(
        args=SimpleNamespace(output_dir=str(tmp_path), should_save=True, save_only_model=False),
        state=SimpleNamespace(global_step=3), _nonfinite_limit=None, _nonfinite_streak=0, _stop_request=request,
        _engine=SimpleNamespace(outcome=SimpleNamespace(stop=True)), engine=SimpleNamespace(resumable=True),
        resume_command=None)
    with pytest.raises(Preempted) as stopped:
        stopping.raise_if_stopped(trainer)
    message = str(stopped.value)
    assert message.startswith("hf_accum: stopped by SIGTERM after optimizer step 3; checkpoint saved to ")
    if late:
        assert "That took 45.0 s, longer than torchrun's 30 s grace period" in message
    else:
        assert "(2.0 s after the signal.)" in message and "grace" not in message
    assert (tmp_path / stopping.STOP_FILE).read_text().strip() == message


def _bad_checkpoints(out):
    """Two checkpoints of a target-16 run, each incomplete in its own way."""
    import torch

    from tests.recipes.test_recipe_checks import checkpoint

    old = checkpoint(out, 2)
    os.remove(os.path.join(old, "trainer_state.json"))
    new = checkpoint(out, 4)
    torch.save({"state": list(range(1000))}, os.path.join(new, "optimizer.pt"))
    with open(os.path.join(new, "optimizer.pt"), "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    return old, new


def test_with_no_complete_checkpoint_a_recipe_says_why_for_each(tmp_path):
    """docs/stopping.md: "with none complete it says why for each": each checkpoint named with its own fault."""
    from hf_accum.recipes import preflight
    from hf_accum.recipes.config import RecipeError

    out = str(tmp_path / "run")
    _bad_checkpoints(out)
    with pytest.raises(RecipeError) as refused:
        preflight.resolve_resume(True, out, 16)
    message = str(refused.value)
    assert re.search(r"checkpoint-2: [^;]*trainer_state\.json", message), message
    assert re.search(r"checkpoint-4: [^;]*optimizer\.pt", message), message
    assert len(message.splitlines()) == 1


def test_a_recipe_refuses_a_bad_checkpoint_by_path_before_the_model_is_built(tmp_path, monkeypatch):
    """docs/stopping.md: a recipe refuses an incomplete checkpoint given by path "before the model is even built"
    (issue 59, item 14: the model was built and the data tokenized first), and output_dir keeps its files."""
    from hf_accum.recipes import run
    from hf_accum.recipes.config import RecipeError

    out = str(tmp_path / "run")
    _, new = _bad_checkpoints(out)
    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(1))
    monkeypatch.setattr(run, "build_tokenizer", lambda *a, **k: built.append(1))
    monkeypatch.setattr(run, "build_data", lambda *a, **k: built.append(1))
    before = sorted(os.walk(out))
    with pytest.raises(RecipeError, match=r"cannot be resumed: its file optimizer\.pt"):
        run.run_recipe("lora_sft", [f"output_dir={out}", f"resume_from_checkpoint={new}"])
    assert built == [] and sorted(os.walk(out)) == before
    assert not json.dumps(before).count("hf_accum_stopped")
