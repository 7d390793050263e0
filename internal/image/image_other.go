//go:build !linux

package image

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/kernflux/opendsec/internal/errdefs"
)

var errLinuxOnly = fmt.Errorf("image store: %w (Linux only)", errdefs.ErrUnimplemented)

func (s *Store) lock(context.Context) (func(), error) { return nil, errLinuxOnly }

type staging struct{ dir string }

func (s *Store) newStaging() (*staging, error) { return nil, errLinuxOnly }
func (st *staging) cleanup()                   {}
func (s *Store) cleanTmp() error               { return nil }
func syncFS(string) error                      { return errLinuxOnly }
func syncDir(string) error                     { return errLinuxOnly }
func removeTree(dir string) error              { return os.RemoveAll(dir) }
func treeSize(string) int64                    { return 0 }
func copyTree(context.Context, string, string, *progress) error {
	return errLinuxOnly
}
func extractTarFile(context.Context, string, string, *progress) error { return errLinuxOnly }
func digestTree(context.Context, string) (string, int64, error)       { return "", 0, errLinuxOnly }

func probeEROFS(string) error                                { return errLinuxOnly }
func mkfsEROFS(context.Context, string, string) error        { return errLinuxOnly }
func fileDigest(string) (string, int64, error)               { return "", 0, errLinuxOnly }
func (s *Store) releaseMounts(context.Context, string) error { return nil }
func (s *Store) unmountLayer(context.Context, string) error  { return nil }
func (s *Store) layerDirs(context.Context, []Layer, string) ([]string, error) {
	return nil, errLinuxOnly
}

func extractTar(context.Context, io.Reader, string, *progress, bool) error { return errLinuxOnly }

func applyLayer(context.Context, string, string, bool, []string) error { return errLinuxOnly }
func isMounted(string) bool                                            { return false }
func unmount(string) error                                             { return errLinuxOnly }

// opaqueXattr marks an OverlayFS opaque directory (tests build such upper
// directories by hand).
const opaqueXattr = "trusted.overlay.opaque"

func pruneEmptyParents(string, []string) {}
