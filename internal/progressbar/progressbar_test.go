package progressbar

import "testing"

func TestBytes(t *testing.T) {
	for b, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1536: "1.5 KiB", 3 << 30: "3.0 GiB"} {
		if got := Bytes(b); got != want {
			t.Errorf("Bytes(%d) = %q, want %q", b, got, want)
		}
	}
}

func TestLine(t *testing.T) {
	want := "\rimport [===============               ]  50% 1.0 MiB, 7 files"
	if got := Line("import", 0.5, 1<<20, 7); got != want {
		t.Errorf("Line = %q, want %q", got, want)
	}
}
