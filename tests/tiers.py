"""The unit tier: which tests spawn nothing, and the guard that keeps it true.

`pytest -m unit` runs the tests listed in UNIT (whole modules, or `module::test` for a module that
also has tests that spawn) in under a minute, for a developer's inner loop. A unit test starts no
process: no subprocess, no multiprocessing, no vLLM engine (it starts its engine core as a
process), no network namespace (made with `ip netns`, a subprocess). While one runs, every way of
starting a process raises SpawnInUnitTest and the test fails even if the code caught it; a test
that needs a process belongs in the full suite: take it out of UNIT.

To see which tests of some files spawn (when adding a module here):
    HWSYNC_TIER_PROBE=/tmp/spawns.txt python -m pytest -q tests/test_x.py
records, without failing anything, the node id of every test that started a process.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

#: modules whose every test spawns nothing, and `module::test` for single tests of mixed modules
UNIT = (
    "tests/test_bench_pause_readings.py",
    "tests/test_bench_shapes.py",
    "tests/test_buffer_pool.py",
    "tests/test_conformance.py",
    "tests/test_cross_node_units.py",
    "tests/test_delta_codec.py",
    "tests/test_delta_plan.py",
    "tests/test_host_copy.py",
    "tests/test_host_threads.py",
    "tests/test_devices.py",
    "tests/test_layering.py",
    "tests/test_mapped_backends.py",
    "tests/test_npu_api_conformance.py",
    "tests/test_npu_decisions.py",
    "tests/test_npu_hccl_groups.py",
    "tests/test_npu_host_register.py",
    "tests/test_offload.py",
    "tests/test_peft_model.py",
    "tests/test_planner.py",
    "tests/test_protocol.py",
    "tests/test_protocol_fuzz.py",
    "tests/test_replay_checks.py",
    "tests/test_shared_index.py",
    "tests/test_source_errors.py::test_the_quick_check_of_an_item_takes_exactly_what_the_one_that_names_the_fault_takes",
    "tests/test_staged.py::test_the_commit_writes_wait_for_every_job_and_raise_the_first_failure_holding_nothing_alive",
    "tests/test_staged_payload.py",
    "tests/test_tiers.py",
    "tests/test_vllm_clients.py",
    "tests/test_vllm_manifest.py",
    "tests/test_vllm_copy_plan.py",  # its engine test is marked vllm and slow: it stays in the full suite
    "tests/test_vllm_copy_plan_moe.py",  # the same
    # mixed modules: the tests of theirs that start nothing
    "tests/test_backend_shape.py::test_entry_point_names_the_backend_module",
    "tests/test_backend_shape.py::test_every_lazy_name_resolves",
    "tests/test_backend_shape.py::test_package_has_the_shape",
    "tests/test_bed.py::test_pick_subnet_rules",
    "tests/test_bed.py::test_unavailable_reasons",
    "tests/test_collective.py::test_duplicate_names_are_refused",
    "tests/test_collective.py::test_owners_are_balanced_and_interleaved",
    "tests/test_collective.py::test_plan_chunks_big_tensors_and_keeps_small_ones_whole",
    "tests/test_control_plane_units.py::test_endpoint_strings_round_trip",
    "tests/test_control_plane_units.py::test_malformed_endpoints_name_the_fix",
    "tests/test_control_plane_units.py::test_a_tcp_sender_prints_its_key_and_an_ipc_sender_none",
    "tests/test_control_plane_units.py::test_without_curve_a_tcp_endpoint_says_what_to_install",
    "tests/test_control_plane_units.py::test_the_drop_log_names_the_peer_once_per_interval",
    "tests/test_control_plane_units.py::test_a_receivers_frames_are_held_to_the_limit_before_they_leave",
    "tests/test_control_plane_units.py::test_messages_are_cut_before_they_travel",
    "tests/test_control_plane_units.py::test_a_manifest_over_the_senders_limit_is_refused_before_it_is_sent",
    "tests/test_cpu_backend.py::test_memory_comes_from_the_os",
    "tests/test_cpu_backend.py::test_rendezvous_address_is_checked",
    "tests/test_cpu_backend.py::test_segment_is_removed_on_close",
    "tests/test_doorbell.py::test_doorbell_post_read_release_between_two_mappings",
    "tests/test_doorbell.py::test_doorbell_supported_follows_the_environment",
    "tests/test_doorbell.py::test_spin_wait_returns_checks_and_times_out",
    "tests/test_hf_checkpoint.py::test_module_is_sent_as_save_pretrained_writes_it",
    "tests/test_hf_checkpoint.py::test_fused_experts_go_under_the_checkpoints_names",
    "tests/test_hf_checkpoint.py::test_tied_head_is_sent_once_and_not_copied",
    "tests/test_hf_checkpoint.py::test_plain_module_sends_a_shared_parameter_once_and_listed_pairs_as_listed",
    "tests/test_into.py::test_receive_needs_load_or_into",
    "tests/test_memory.py::test_balanced_report_passes_silently",
    "tests/test_memory.py::test_bucket_alignment_and_arguments",
    "tests/test_memory.py::test_bucket_from_the_least_free_rank",
    "tests/test_memory.py::test_bucket_is_capped_and_floored",
    "tests/test_memory.py::test_bucket_refused_when_even_the_floor_does_not_fit",
    "tests/test_memory.py::test_check_balance_rejects_bad_arguments",
    "tests/test_memory.py::test_low_rank_is_named_and_warned",
    "tests/test_memory.py::test_median_names_the_odd_rank_in_either_direction",
    "tests/test_memory.py::test_min_gap_ignores_noise_on_small_figures",
    "tests/test_memory.py::test_raise_mode_raises_a_hwsync_error",
    "tests/test_memory.py::test_report_round_trips_through_a_dict",
    "tests/test_memory.py::test_rows_from_elsewhere_are_joined_and_renumbered",
    "tests/test_memory.py::test_single_process_report_without_a_communicator",
    "tests/test_registry.py::test_explicit_never_falls_back_in_process",
    "tests/test_registry.py::test_resolved_name_is_written_back",
    "tests/test_sim_accelerator.py::test_a_copy_read_before_synchronize_sees_stale_bytes",
    "tests/test_sim_accelerator.py::test_a_device_to_host_copy_waits_for_queued_work",
    "tests/test_sim_accelerator.py::test_a_host_source_is_read_when_copy_returns",
    "tests/test_sim_accelerator.py::test_synchronizing_another_device_does_not_finish_the_copy",
    "tests/test_sim_accelerator.py::test_a_new_thread_starts_on_device_0",
    "tests/test_sim_accelerator.py::test_using_a_device_1_tensor_with_device_0_current_raises",
    "tests/test_sim_accelerator.py::test_numpy_on_a_device_tensor_fails_as_on_a_gpu",
    "tests/test_sim_accelerator.py::test_parameters_move_with_data_and_back",
    "tests/test_sim_accelerator.py::test_an_allocation_past_free_memory_is_refused",
    "tests/test_sim_accelerator.py::test_fresh_memory_is_not_zero_and_freed_memory_is_poisoned",
    "tests/test_sim_accelerator.py::test_a_read_still_queued_when_its_buffer_is_released_and_refilled_sees_poison",
    "tests/test_sim_accelerator.py::test_shm_release_waits_for_the_staging_copy_that_still_reads_the_segment",
    "tests/test_sim_accelerator.py::test_a_receivers_read_only_segments_are_pinned_read_only",
    "tests/test_sim_accelerator.py::test_an_export_never_mapped_stays_parked_and_is_reported_when_asked",
    # (the counter-file tests start torch's shm manager, a process)
    "tests/test_ipc_counters.py::test_a_gone_file_reads_as_nothing_to_release_and_a_path_is_refused",
    "tests/test_ipc_counters.py::test_a_mapping_that_fails_its_check_is_unmapped_before_the_exports_are_released",
    "tests/test_sim_accelerator.py::test_two_ranks_on_one_device_are_refused",
    "tests/test_source_errors.py::test_the_planner_names_a_bad_item_of_its_sources_alike",
    "tests/test_transfer.py::test_bad_arguments_name_the_fix",
    "tests/test_transfer.py::test_ipc_directory_is_private_and_removed",
    "tests/test_vllm_ascend_nz.py",
    "tests/test_vllm_ascend_extension.py::test_the_reload_runs_under_the_models_device",
    "tests/test_vllm_ascend_extension.py::test_the_device_is_synchronized_once_after_the_finalize",
)


class SpawnInUnitTest(Exception):
    """A test of the unit tier tried to start a process."""


def mark_unit(items: list[pytest.Item]) -> None:
    """Put the `unit` marker on the listed tests: every test of a listed module except its slow and vLLM ones
    (they stay in the full suite); a test listed by itself that is slow or runs vLLM is an error."""
    for item in items:
        module, _, rest = item.nodeid.partition("::")
        by_name = f"{module}::{rest.partition('[')[0]}" in UNIT
        if not by_name and module not in UNIT:
            continue
        heavy = [name for name in ("slow", "vllm") if item.get_closest_marker(name) is not None]
        if heavy and by_name:
            raise pytest.UsageError(f"{item.nodeid} is marked {heavy[0]} and listed in tests/tiers.py UNIT: a unit "
                                    f"test is fast and starts no engine; take it out of UNIT")
        if not heavy:
            item.add_marker(pytest.mark.unit)


#: (owner, attribute) of every way a test could start a process
_SPAWNERS: list[tuple[Any, str]] = [
    (subprocess.Popen, "_execute_child"),  # subprocess.run/call/check_output and Popen
    (multiprocessing.process.BaseProcess, "start"),  # every multiprocessing context, pools, vLLM's engine core
    *[(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "unshare")
      if hasattr(os, name)],
]


@contextmanager
def spawns_refused(what: str, refuse: bool = True) -> Iterator[list[str]]:
    """While inside, each attempt to start a process is recorded in the yielded list (and refused if `refuse`)."""
    attempts: list[str] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in _SPAWNERS]

    def guard(owner: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def guarded(*args: Any, **kwargs: Any) -> Any:
            attempts.append(label)
            if refuse:
                raise SpawnInUnitTest(f"{what} started a process ({label}): a unit test spawns nothing; "
                                      f"take it out of UNIT in tests/tiers.py")
            return original(*args, **kwargs)

        return guarded

    for owner, name, original in saved:
        setattr(owner, name, guard(owner, name, original))
    try:
        yield attempts
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextmanager
def guarded(item: pytest.Item) -> Iterator[None]:
    """Around one phase (setup, call, teardown) of a test: a unit test that started a process fails.

    With HWSYNC_TIER_PROBE=PATH every test is watched and nothing refused: the node id of each test that
    started a process is appended to PATH.
    """
    probe = os.environ.get("HWSYNC_TIER_PROBE")
    if not probe and item.get_closest_marker("unit") is None:
        yield
        return
    with spawns_refused(item.nodeid, refuse=not probe) as attempts:
        yield
    if probe and attempts:
        with open(probe, "a") as out:
            out.write(f"{item.nodeid}\t{' '.join(sorted(set(attempts)))}\n")
    elif attempts:
        pytest.fail(f"{item.nodeid} started a process ({', '.join(sorted(set(attempts)))}) and caught the error: "
                    f"a unit test spawns nothing; take it out of UNIT in tests/tiers.py", pytrace=False)
