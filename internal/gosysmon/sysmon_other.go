//go:build !linux

package gosysmon

// SlackNS is the timer slack Slow gives sysmon on Linux.
const SlackNS = 1_000_000

// Slow does nothing here: the timer slack is Linux's.
func Slow() {}
