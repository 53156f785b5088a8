"""The records: what a format is (:mod:`.formats`), the choices a cast makes
(:mod:`.modes`), the cast record (:mod:`.cast`), the implementations' presets
(:mod:`.recipes`), the table of every named cast (:mod:`.presets`) and the spec grammar
that reads it (:mod:`.castspec`). Nothing here imports torch.
"""
