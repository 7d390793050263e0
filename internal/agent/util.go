package agent

import (
	"bytes"
	"io"
	"slices"
	"strconv"
	"strings"
)

func itoa(i int) string { return strconv.Itoa(i) }

func splitComma(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		out = append(out, strings.TrimSpace(p))
	}
	return out
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(slices.Clone(b)) }
