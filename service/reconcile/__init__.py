"""The steps of the reconcile loop (service/reconciler.py), one module each: what Ray reports,
applied (`watch`); graceful stops (`stops`); launches (`launch`); a scheduling decision applied
(`scheduling_pass`), with what a preemption and a resize record and how they end (`preemption`,
`resize`). None of them imports the loop, nor runs by itself: the loop calls them in order.
"""
