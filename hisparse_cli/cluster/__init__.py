"""Batches on a Ray cluster: `hisparse batch --ray` and the Ray Data entry point.

connect.py   RayOptions, joining or starting a cluster, how many workers and what each holds
worker.py    BatchWorker: a Ray actor that loads the model once and summarizes one document
             at a time (summarize/batch_document.run_document, as the local batch does)
runner.py    RayRunner: the DocumentRunner that hands documents to the workers, retries a
             dead worker's document once elsewhere; the driver alone writes the results file
board.py     the live board of workers on the driver's console
ray_data.py  Summarizer, the callable class for `Dataset.map_batches`

Ray is an optional extra (`pip install "hisparse[ray]"`); nothing here imports it at module
level, so the rest of hisparse never needs it.
"""
