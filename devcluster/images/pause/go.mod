module disagg.local/pause

go 1.22
