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

func TestStep(t *testing.T) {
	for _, tc := range []struct {
		i, n int
		want string
	}{
		{0, 4, "[                    ] 0/4 FROM x"},
		{2, 4, "[==========          ] 2/4 FROM x"},
		{4, 4, "[====================] 4/4 FROM x"},
		{3, 12, "[=====               ]  3/12 FROM x"},
	} {
		if got := Step(tc.i, tc.n, "FROM x"); got != tc.want {
			t.Errorf("Step(%d, %d) = %q, want %q", tc.i, tc.n, got, tc.want)
		}
	}
}
