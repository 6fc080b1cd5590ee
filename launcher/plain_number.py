"""The plain number every count, rank and port the launcher reads from a flag or an environment
variable is read as: `--ranks`, `--nnodes`, `SLURM_NODEID`, `PET_NPROC_PER_NODE` and the rest.
It sits here, above the rooms, because both `launch` and `clusters` read such numbers."""


def plain_number(text: str, digits: int = 9) -> int | None:
    """`text` as a number where it is ASCII digits alone, at most `digits` of them; else None.

    str.isdigit() takes "²", which int() refuses; int() takes " 4", "+4", "4_0" and "٤", which
    no flag or variable means; and the bound keeps int() off a 5,000-digit string."""
    if text.isascii() and text.isdigit() and len(text) <= digits:
        return int(text)
    return None
