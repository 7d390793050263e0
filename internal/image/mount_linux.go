package image

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
)

func fileDigest(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, fmt.Errorf("digest %s: %w", filepath.Base(path), err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("digest %s: %w", filepath.Base(path), err)
	}
	return fmt.Sprintf("sha256:%x", h.Sum(nil)), n, nil
}

func (s *Store) lockMounts(ctx context.Context) (func(), error) {
	unlock, err := lockFile(ctx, filepath.Join(s.mountDir, "lock"))
	if err != nil {
		return nil, fmt.Errorf("image mounts: %w", err)
	}
	return unlock, nil
}

// layerDirs returns the directories of layers (in the order given): a
// plain layer's own directory in the store, or an EROFS layer's mount
// point on this node, mounting it if needed. With holder set, it records
// holder as a user of every mount, so the mounts stay until Release.
func (s *Store) layerDirs(ctx context.Context, layers []Layer, holder string) ([]string, error) {
	if len(layers) == 0 {
		return nil, fmt.Errorf("image has no layers: %w", errdefs.ErrInternal)
	}
	infos := make([]layerInfo, len(layers))
	needMount := false
	for i, l := range layers {
		li, err := s.readLayer(l.Digest)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", l.Digest, errors.Join(errdefs.ErrInternal, err))
		}
		infos[i] = li
		needMount = needMount || li.Format == FormatEROFS
	}
	if needMount && !s.canMount {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "the image has EROFS layers but this node cannot mount EROFS (it needs root, the erofs kernel driver and erofs-utils)")
	}
	var unlock func()
	if needMount {
		var err error
		if unlock, err = s.lockMounts(ctx); err != nil {
			return nil, err
		}
		defer unlock()
	}
	dirs := make([]string, len(layers))
	for i, li := range infos {
		h, _ := digestHex(li.Digest)
		if li.Format != FormatEROFS {
			dirs[i] = s.path("layers", h, "dir")
			continue
		}
		mnt := filepath.Join(s.mountDir, h)
		if holder != "" {
			// The ref goes first: a crash between it and the mount leaves a
			// ref that Release cleans up, never a mount nobody owns.
			if err := s.addMountRef(h, holder); err != nil {
				return nil, fmt.Errorf("image mount ref: %w", err)
			}
		}
		if isMounted(mnt) {
			dirs[i] = mnt
			continue
		}
		if err := os.MkdirAll(mnt, 0o755); err != nil {
			return nil, fmt.Errorf("image mount point: %w", err)
		}
		if err := mountEROFS(s.path("layers", h, "layer.erofs"), mnt); err != nil {
			return nil, err
		}
		log.G(ctx).Debug("image layer mounted", "layer", li.Digest, "mount", mnt)
		dirs[i] = mnt
	}
	return dirs, nil
}

// addMountRef records holder as a user of the mount of layer h: a file in
// refs/<h>/ made as a hard link of the layer's anchor (anchors/<h>, made
// once), a new directory entry without a new inode. On file systems that
// scan recently freed inodes to allocate one (ext4 without a journal,
// ~0.25 ms of CPU each) a ref per sandbox was a new file, as the store's
// holds were (writeHold). Where hard links fail, the ref is written. The
// caller holds the mounts lock.
func (s *Store) addMountRef(h, holder string) error {
	rdir := filepath.Join(s.mountDir, "refs", h)
	if err := os.MkdirAll(rdir, 0o755); err != nil {
		return err
	}
	ref := filepath.Join(rdir, holder)
	anchor := filepath.Join(s.mountDir, "anchors", h)
	err := os.Link(anchor, ref)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(filepath.Dir(anchor), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(anchor, nil, 0o644); err != nil {
			return err
		}
		err = os.Link(anchor, ref)
	}
	switch {
	case err == nil, errors.Is(err, fs.ErrExist):
		return nil // its existence is the ref
	default:
		return os.WriteFile(ref, nil, 0o644)
	}
}

// releaseMounts drops holder's mount refs and unmounts the layers left
// without any.
func (s *Store) releaseMounts(ctx context.Context, holder string) error {
	if !s.canMount {
		return nil
	}
	unlock, err := s.lockMounts(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	ents, err := os.ReadDir(filepath.Join(s.mountDir, "refs"))
	if err != nil {
		return fmt.Errorf("release image mounts: %w", err)
	}
	for _, e := range ents {
		rdir := filepath.Join(s.mountDir, "refs", e.Name())
		if err := os.Remove(filepath.Join(rdir, holder)); errors.Is(err, fs.ErrNotExist) {
			continue
		} else if err != nil {
			return fmt.Errorf("release image mount: %w", err)
		}
		if os.Remove(rdir) != nil {
			continue // other holders remain
		}
		mnt := filepath.Join(s.mountDir, e.Name())
		if err := unmount(mnt); err != nil {
			return err
		}
		_ = os.Remove(mnt)
		log.G(ctx).Debug("image layer unmounted", "layer", "sha256:"+e.Name())
	}
	return nil
}

// unmountLayer unmounts layer hex on this node unless a holder here uses
// it. Prune calls it with the store lock held.
func (s *Store) unmountLayer(ctx context.Context, h string) error {
	if !s.canMount {
		return nil
	}
	unlock, err := s.lockMounts(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if hs, err := os.ReadDir(filepath.Join(s.mountDir, "refs", h)); err == nil && len(hs) > 0 {
		return fmt.Errorf("layer sha256:%s is held on this node but not in the store: %w", h, errdefs.ErrInternal)
	}
	mnt := filepath.Join(s.mountDir, h)
	if isMounted(mnt) {
		if err := unmount(mnt); err != nil {
			return err
		}
	}
	if err := os.Remove(mnt); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove mount point: %w", err)
	}
	return nil
}
