// Package progressbar renders the one-line progress bars and byte sizes the
// command-line tools (opendsec, opendsecctl) print.
package progressbar

import (
	"fmt"
	"strings"
)

// width is the bar's length in characters.
const width = 30

// Line is one redraw of a bar: a carriage return, label, the bar filled to
// frac (0..1), its percentage, bytes so far and files so far.
func Line(label string, frac float64, bytes, files int64) string {
	n := int(frac * width)
	return fmt.Sprintf("\r%s [%s%s] %3.0f%% %s, %d files", label, strings.Repeat("=", n), strings.Repeat(" ", width-n), frac*100, Bytes(bytes), files)
}

// Bytes formats b in binary units: "512 B", "1.5 KiB", "2.0 GiB".
func Bytes(b int64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%d B", b)
	}
	div, exp := int64(unit), 0
	for n := b / unit; n >= unit; n /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(b)/float64(div), "KMGTPE"[exp])
}

// stepWidth is the length of a step bar.
const stepWidth = 20

// Step is one line of a multi-step job (an image build): a bar filled to
// index of total, the count, and text ("RUN make", "COPY . /app (cached)").
func Step(index, total int, text string) string {
	n := 0
	if total > 0 {
		n = min(stepWidth, index*stepWidth/total)
	}
	w := len(fmt.Sprint(total))
	return fmt.Sprintf("[%s%s] %*d/%d %s", strings.Repeat("=", n), strings.Repeat(" ", stepWidth-n), w, index, total, text)
}
