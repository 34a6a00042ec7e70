"""Which stage works on which microbatch at which step, for each pipeline schedule.

The index functions take plain ints or TF int tensors alike (only +, -, //, %, <, >=, &
on them), so the loops in forward.py and one_f_one_b.py and the text table of
`pipeline_schedule` read the same arithmetic.

Circular (interleaved) schedule, the GSPMD/Praxis way: S devices hold V layers each
(layer k * S + d on device d, its "repeat" k); a microbatch enters device 0, passes
devices 0..S-1, wraps from device S-1 back to device 0 for its next repeat, and leaves
after V rounds. Microbatches go in groups of S: device d's u-th work item (u = step - d)
is microbatch (u // (V S)) S + u % S at repeat (u % (V S)) // S. The forward takes
V M + S - 1 steps of one layer each, V M of them busy: bubble (S - 1) / (V M + S - 1).
GPipe is the case V = 1 (microbatch step - d).

1F1B as one SPMD program, in ticks: every tick every stage runs either a forward or a
backward (stage s forwards when tick - s is even, else backwards), so a microbatch's
forward moves one stage per tick, its backward one stage back per tick, and a stage
alternates F and B in the steady state. Microbatch m: forward on stage s at tick 2m + s,
backward at tick 2m + 2S - 1 - s, (S - 1 - s) * 2 + 1 ticks later; the last stage
backwards right after its forward. 2M + 2S - 2 ticks, 2M busy on every stage: bubble
(S - 1) / (M + S - 1), the classic 1F1B's; stage s holds the inputs of S - s
microbatches (forwarded, not yet backwarded), S slots of a ring at most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from gspmd_tf.errors import ShardingError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
# the name scope gt.pipeline_value_and_grad traces under: it tells a report (e.g. the
# HTML one, which sees only the traced graph's op names) which schedule ran
_SCOPE = re.compile(r"(?:^|/)pipeline_(gpipe|1f1b|interleaved)_S(\d+)_M(\d+)_V(\d+)"
                    r"(?:_\d+)?/")


def circular_steps(stages, microbatches, virtual=1):
    """Forward steps of the circular schedule: V M + S - 1."""
    return virtual * microbatches + stages - 1


def circular_work(step, device, stages, microbatches, virtual=1):
    """(microbatch, repeat, busy) of `device` at forward step `step` (circular schedule)."""
    item = step - device
    per_group = virtual * stages
    microbatch = (item // per_group) * stages + item % stages
    repeat = (item % per_group) // stages
    return microbatch, repeat, (item >= 0) & (item < virtual * microbatches)


def circular_exit_step(microbatch, stages, virtual=1):
    """The forward step at which device S - 1 finishes `microbatch`'s last layer."""
    group, index = divmod(microbatch, stages)
    return stages - 1 + group * virtual * stages + (virtual - 1) * stages + index


def one_f_one_b_ticks(stages, microbatches):
    """Ticks of the 1F1B loop: 2 M + 2 S - 2."""
    return 2 * microbatches + 2 * stages - 2


def one_f_one_b_work(tick, stage, stages, microbatches):
    """(microbatch, forward, busy) of `stage` at 1F1B tick `tick`: forward says whether
    the stage runs a forward (else a backward), busy whether the microbatch exists."""
    forward = (tick - stage) % 2 < 1
    as_int = 1 - (tick - stage) % 2  # forward as 0/1, for ints and tensors alike
    microbatch = (as_int * ((tick - stage) // 2)
                  + (1 - as_int) * ((tick + stage + 1) // 2 - stages))
    return microbatch, forward, (microbatch >= 0) & (microbatch < microbatches)


def stash_slots(stages):
    """Stage inputs a 1F1B stage keeps between a microbatch's forward and backward: the
    first stage's S, the most of any stage (every stage gets as many; microbatch m in
    slot m % S)."""
    return stages


def check_schedule(schedule, stages, microbatches, virtual):
    """A ShardingError naming what to change when the schedule cannot run these sizes."""
    if schedule not in SCHEDULES:
        raise ShardingError(f"pipeline: schedule {schedule!r} is none of {SCHEDULES}")
    if virtual < 1 or (schedule != "interleaved" and virtual != 1):
        raise ShardingError(f"pipeline: virtual_stages={virtual} needs schedule="
                            "'interleaved' (and at least 1)")
    if schedule == "interleaved" and microbatches % stages:
        raise ShardingError(
            f"pipeline: the interleaved schedule sends microbatches round in groups of "
            f"the {stages} devices; {microbatches} microbatches is no multiple of "
            f"{stages}: give a multiple of {stages}")


@dataclass(frozen=True)
class PipelineSchedule:
    """The work of each device at each time slot of a schedule (forward and backward).

    cells[d][j] is what device d does in slot j: "F3" (forward of microbatch 3), "B3"
    (its backward), with ".k" for repeat k in the interleaved schedule, or "" (idle).
    A slot is one forward or one backward of one layer group (a stage; a 1/V stage for
    interleaved); for 1F1B a slot is one tick of its loop.
    """

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    cells: tuple

    @property
    def bubble(self) -> Fraction:
        """Idle slots over all slots (the same on every device)."""
        idle = sum(cell == "" for row in self.cells for cell in row)
        return Fraction(idle, sum(len(row) for row in self.cells))

    def text(self) -> str:
        """The table: one row per device, one column per slot, and the bubble."""
        width = max(3, max(len(cell) for row in self.cells for cell in row))
        slots = len(self.cells[0])
        lines = ["slot     " + " ".join(f"{j:>{width}}" for j in range(slots))]
        for device, row in enumerate(self.cells):
            lines.append(f"stage {device:<3}" + " ".join(f"{cell or '.':>{width}}"
                                                         for cell in row))
        lines.append(f"bubble {self.bubble} = {float(self.bubble):.3f} ({self.schedule}, "
                     f"S={self.stages}, M={self.microbatches}, V={self.virtual})")
        return "\n".join(lines)

    def __str__(self):
        return self.text()


def pipeline_schedule(schedule, stages, microbatches, virtual_stages=1) -> PipelineSchedule:
    """The time table of `schedule` ("gpipe", "1f1b" or "interleaved") for S stages
    (devices of the stage axis), M microbatches and V virtual stages: which device runs
    which microbatch's forward or backward at which slot, as gt.pipeline_value_and_grad
    runs it. str() of the result is a text table; .bubble the idle fraction: (S-1)/(M+S-1)
    for GPipe and 1F1B, (S-1)/(V M+S-1) interleaved."""
    check_schedule(schedule, stages, microbatches, virtual_stages)
    rows = [_one_f_one_b_row(d, stages, microbatches) if schedule == "1f1b"
            else _circular_row(d, stages, microbatches, virtual_stages)
            for d in range(stages)]
    return PipelineSchedule(schedule, stages, microbatches, virtual_stages, tuple(rows))


def _circular_row(device, stages, microbatches, virtual):
    """Forward steps in order, then the backward: TF's gradient loop runs them reversed."""
    forward = []
    for step in range(circular_steps(stages, microbatches, virtual)):
        microbatch, repeat, busy = circular_work(step, device, stages, microbatches,
                                                 virtual)
        suffix = f".{repeat}" if virtual > 1 else ""
        forward.append(f"{microbatch}{suffix}" if busy else "")
    return tuple(["F" + c if c else "" for c in forward] +
                 ["B" + c if c else "" for c in reversed(forward)])


def _one_f_one_b_row(stage, stages, microbatches):
    row = []
    for tick in range(one_f_one_b_ticks(stages, microbatches)):
        microbatch, forward, busy = one_f_one_b_work(tick, stage, stages, microbatches)
        row.append(f"{'F' if forward else 'B'}{microbatch}" if busy else "")
    return tuple(row)


def scope_name(schedule, stages, microbatches, virtual):
    """The name scope of a pipeline's ops, naming its schedule and sizes."""
    return f"pipeline_{schedule}_S{stages}_M{microbatches}_V{virtual}"


def schedules_in(names) -> list:
    """The PipelineSchedule of each pipeline whose scope (scope_name) one of the op
    `names` lies in, in order of first appearance, each once."""
    found = {}
    for name in names:
        match = _SCOPE.search(name)
        if match and match.groups() not in found:
            schedule, *sizes = match.groups()
            found[match.groups()] = pipeline_schedule(schedule, *map(int, sizes))
    return list(found.values())


def layer_order(stages, virtual_stages):
    """The model's layer indices in the order a circular pipeline takes its params:
    each device's V layers contiguous (entry d * V + k is layer k * S + d), so splitting
    the leading dim over the stage axis gives device d layers d, S + d, 2 S + d, ...
    Stack your layers as `tf.gather(layers, layer_order(S, V))`."""
    return [repeat * stages + device for device in range(stages)
            for repeat in range(virtual_stages)]
