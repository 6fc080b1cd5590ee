"""The kinds of checkpoint store, one module each: a subclass of
`launcher.checkpoint.store.Store` whose `schemes` name the locations it takes. `kind_for`
finds every kind here, so a new one is a new module and nothing more."""
