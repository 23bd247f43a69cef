"""loadtest/bench/sampled_profile.py: py-spy's raw samples read, and sorted by phase and package."""

from __future__ import annotations

from loadtest.bench.sampled_profile import REST, by_package, by_phase, parse_raw

ROOT = "Runner.run (asyncio/runners.py:118)"
LAYER = "RequestLayer._serve (gateway/http/request_layer.py:130)"
PLAN = "Planner.plan (gateway/serving/planner.py:199)"
RAW = [
    f"{ROOT};{LAYER};{PLAN};route (routing/pipeline.py:190);decide (routing/decide.py:150) 7",
    f"{ROOT};{LAYER};{PLAN};block_hashes (routing/hashing.py:82) 3",
    f"{ROOT};{LAYER};deadline_receive (gateway/http/exposure.py:154) 2",
    f"{ROOT};{LAYER};RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:522) 4",
    f"{ROOT};AccessWatch.seen (gateway/telemetry/logs.py:186);__init__ (<string>:3) 1",
    f"{ROOT} 5",
    "",
]


def test_raw_lines_are_frames_root_first_and_a_count() -> None:
    samples = parse_raw(RAW)
    assert len(samples) == 6  # the blank line is no sample
    frames, n = samples[0]
    assert n == 7
    assert frames[0] == ("Runner.run", "asyncio/runners.py")
    assert frames[-1] == ("decide", "routing/decide.py")


def test_a_sample_goes_to_the_innermost_phase_that_names_a_frame_of_it() -> None:
    phases = by_phase(parse_raw(RAW))
    assert phases["plan: decide (route)"] == 7  # inside the plan: the decision's own row
    assert phases["plan: prompt, hash, lookup, the rest"] == 3
    assert phases["request layer + body deadline"] == 2
    assert phases["uvicorn send (the socket write; the floor's too)"] == 4  # inside the layer
    assert phases["access record (open, each message, close)"] == 1  # a method's prefix
    assert phases[REST] == 5
    assert sum(phases.values()) == 22


def test_a_sample_goes_to_the_package_of_its_innermost_frame() -> None:
    packages = by_package(parse_raw(RAW))
    assert packages == {
        "routing": 10,  # routing/'s own modules; a subpackage (routing/policies) apart
        "asyncio": 5,
        "uvicorn": 4,
        "gateway/http": 2,
        "generated code, frozen modules": 1,
    }
    assert list(packages) == sorted(packages, key=lambda p: -packages[p])
