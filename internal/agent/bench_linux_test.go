package agent

import (
	"testing"
)

// BenchmarkStartTrue is the exec round trip through the agent: Start
// /bin/true over a unix socket and read the stream to its end.
func BenchmarkStartTrue(b *testing.B) {
	e := newEnvB(b)
	b.ResetTimer()
	for b.Loop() {
		s, err := e.proc.Start(b.Context(), startReq("/bin/true"))
		if err != nil {
			b.Fatal(err)
		}
		for s.Receive() {
		}
		if err := s.Err(); err != nil {
			b.Fatal(err)
		}
	}
}
