"""The sync: its settings, its one pipeline, and what a sender does around it, whichever the path.

options.py   SenderOptions / CrossNodeOptions: the settings every sender takes, typed, one docstring a field
prepared.py  Prepared: one sync as the pipeline hands it to a carrier (what streams, what is announced)
pipeline.py  Carrier (the contract of the two carriers) and SyncPipeline (the steps every sync runs)
sender.py    Sender: one sync at a time, close() from any thread, the delta baseline, for both senders
"""
