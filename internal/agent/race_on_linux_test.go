//go:build race

package agent

// raceEnabled: the race detector multiplies memory use, so RSS bounds are not checked.
const raceEnabled = true
