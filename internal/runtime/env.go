package runtime

import (
	"strings"

	"github.com/kernflux/opendsec/internal/errdefs"
)

var errNoMounter = errdefs.New(errdefs.ErrInvalidArgument, "rootfs: layers are not directories and no layer mounter was given")

// MergeEnv returns base with over on top ("K=V" entries): one entry per key,
// over's value winning, in base's order with over's new keys after.
func MergeEnv(base, over []string) []string {
	out := make([]string, 0, len(base)+len(over))
	idx := make(map[string]int, len(base)+len(over))
	for _, list := range [][]string{base, over} {
		for _, e := range list {
			k, _, _ := strings.Cut(e, "=")
			if i, ok := idx[k]; ok {
				out[i] = e
				continue
			}
			idx[k] = len(out)
			out = append(out, e)
		}
	}
	return out
}
