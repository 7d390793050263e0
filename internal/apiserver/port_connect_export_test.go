package apiserver

// ActiveConnectPortRelays is how many ConnectPort relay goroutines run.
func ActiveConnectPortRelays() int64 { return activeRelays.Load() }
