package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// remoteRef is a parsed "ID:/path".
type remoteRef struct {
	id, path string
}

// parseRemote reports whether s is "ID:/path" with a [a-z0-9] ID.
func parseRemote(s string) (remoteRef, bool) {
	id, p, ok := strings.Cut(s, ":")
	if !ok || id == "" || !strings.HasPrefix(p, "/") {
		return remoteRef{}, false
	}
	for _, r := range id {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') {
			return remoteRef{}, false
		}
	}
	return remoteRef{id: id, path: p}, true
}

func secondsDuration(s int64) time.Duration { return time.Duration(s) * time.Second }

func (a *app) cpCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file into or out of a sandbox; one side is ID:/path, - is stdin or stdout",
		Example: `  opendsecctl files cp ./train.py n001sb0001:/work/train.py
  opendsecctl files cp n001sb0001:/work/out.csv ./out.csv
  tar c data | opendsecctl files cp - n001sb0001:/tmp/data.tar`,
		Args: exactArgs(2, "SRC DST"),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, srcRemote := parseRemote(args[0])
			dst, dstRemote := parseRemote(args[1])
			if srcRemote == dstRemote {
				return usagef("files cp: exactly one of SRC and DST must be a sandbox path ID:/path")
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			if dstRemote {
				return a.upload(cmd.Context(), c, args[0], dst)
			}
			return a.download(cmd.Context(), c, src, args[1])
		},
	}
}

func (a *app) upload(ctx context.Context, c *opendsec.Client, local string, dst remoteRef) error {
	var (
		r    io.Reader
		size int64 = -1
	)
	if local == "-" {
		if strings.HasSuffix(dst.path, "/") {
			return usagef("DST: name the file when SRC is -, e.g. %s:%sdata", dst.id, dst.path)
		}
		r = a.stdin
	} else {
		f, err := os.Open(local)
		if err != nil {
			return fmt.Errorf("open %s: %w", local, err)
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return fmt.Errorf("stat %s: %w", local, err)
		}
		if st.IsDir() {
			return usagef("SRC: %s is a directory; cp copies one file (use tar and - for trees)", local)
		}
		r, size = f, st.Size()
		if strings.HasSuffix(dst.path, "/") {
			dst.path += filepath.Base(local)
		}
	}
	info, err := c.WriteFile(ctx, dst.id, dst.path, r, size)
	if err != nil {
		return err
	}
	if a.output == "json" {
		return printJSON(a.stdout, info)
	}
	return nil
}

func (a *app) download(ctx context.Context, c *opendsec.Client, src remoteRef, local string) error {
	if local == "-" {
		_, err := c.ReadFile(ctx, src.id, src.path, a.stdout)
		return err
	}
	if st, err := os.Stat(local); err == nil && st.IsDir() {
		local = filepath.Join(local, path.Base(src.path))
	}
	// Write next to the target and rename, so a failed copy leaves nothing.
	tmp, err := os.CreateTemp(filepath.Dir(local), ".opendsecctl-cp-*")
	if err != nil {
		return fmt.Errorf("create local file: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := c.ReadFile(ctx, src.id, src.path, tmp); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return fmt.Errorf("set mode of %s: %w", local, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", local, err)
	}
	if err := os.Rename(tmp.Name(), local); err != nil {
		return fmt.Errorf("move download into place: %w", err)
	}
	return nil
}

func (a *app) lsCommand() *cobra.Command {
	var depth int
	cmd := &cobra.Command{
		Use:     "ls ID:/path",
		Short:   "List a directory inside a sandbox",
		Example: `  opendsecctl files ls n001sb0001:/tmp --depth 2`,
		Args:    exactArgs(1, "ID:/path"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, ok := parseRemote(args[0])
			if !ok {
				return usagef("files ls: %q is not ID:/path", args[0])
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			entries, err := c.ListDir(cmd.Context(), ref.id, ref.path, depth)
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, &opendsecv1.ListDirResponse{Entries: entries})
			}
			return printFileTable(a.stdout, entries)
		},
	}
	cmd.Flags().IntVar(&depth, "depth", 1, "levels to descend")
	return cmd
}
