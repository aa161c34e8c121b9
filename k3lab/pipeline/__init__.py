"""The generic pipeline: plan -> read (sources) -> transform -> write -> record, its runner, verify and batch."""
