"""`disagg compare`: push against pull on a user's own deployment and load.

Pure parts decide: `workload` (what is replayed and when), `schedule` (the ABBA order of modes), `stats`
(percentiles and bootstrap intervals), `verdict` (which mode to recommend, or that the difference is noise) and
`report` (the typed report, its markdown and its SVG plot). Nothing in them does I/O.
"""
