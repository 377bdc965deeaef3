"""Training on several ranks: which rank a process is and its collectives (`distributed`), starting the ranks
(`launch`), the loader across them (`distloader`), the data-parallel and latent-sharded trainers (`dataparallel`,
`sharded`) and the modes and loop that use them (`parallel`). The one-process loop (training.train) imports none."""
