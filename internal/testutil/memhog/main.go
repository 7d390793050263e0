// Command memhog holds memory the way a rollout does, for the reclaim
// tests and the pause benchmark: it writes -mib MiB of anonymous memory
// (-pattern random: incompressible; text: log-like lines, compressible;
// sparse: pages of zeros with one byte set), then counts forever, writing the count to -count
// every -tick. When the file -verify names appears it checks every byte
// of its memory and answers in -verify + ".out" ("ok <sum>" or "bad ...").
package main

import (
	"bytes"
	"flag"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"runtime/debug"
	"strconv"
	"time"
)

func main() {
	mib := flag.Int("mib", 20, "MiB of memory to write")
	pattern := flag.String("pattern", "random", "random, text or sparse")
	count := flag.String("count", "/count", "file the counter is written to")
	verify := flag.String("verify", "/verify", "when this file appears, check the memory")
	tick := flag.Duration("tick", 20*time.Millisecond, "how often the counter counts")
	flag.Parse()
	debug.SetGCPercent(-1) // the buffer is all there is; nothing else to collect
	buf := make([]byte, *mib<<20)
	fill(buf, *pattern)
	sum := crc32.ChecksumIEEE(buf)
	for i := 1; ; i++ {
		tmp := *count + ".tmp"
		if err := os.WriteFile(tmp, strconv.AppendInt(nil, int64(i), 10), 0o644); err == nil {
			_ = os.Rename(tmp, *count)
		}
		if _, err := os.Stat(*verify); err == nil {
			got := crc32.ChecksumIEEE(buf)
			ans := fmt.Sprintf("ok %08x", got)
			if got != sum {
				ans = fmt.Sprintf("bad %08x want %08x", got, sum)
			}
			_ = os.WriteFile(*verify+".out", []byte(ans), 0o644)
			_ = os.Remove(*verify)
		}
		time.Sleep(*tick)
	}
}

func fill(buf []byte, pattern string) {
	switch pattern {
	case "sparse":
		for i := 0; i < len(buf); i += 4096 {
			buf[i] = 1
		}
	case "text":
		r := rand.New(rand.NewPCG(1, 2))
		var line bytes.Buffer
		for off := 0; off < len(buf); {
			line.Reset()
			fmt.Fprintf(&line, "step=%d reward=%.4f action=%d obs=[%d %d %d] done=false\n",
				off, r.Float64(), r.IntN(16), r.IntN(256), r.IntN(256), r.IntN(256))
			off += copy(buf[off:], line.Bytes())
		}
	default:
		r := rand.NewChaCha8([32]byte{7})
		_, _ = r.Read(buf)
	}
}
