//go:build !linux

package imagebuild

import (
	"context"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
)

var errLinuxOnly = errdefs.New(errdefs.ErrUnimplemented, "image builds run on Linux nodes only")

func (bd *builder) mkdirLayer(context.Context, *stageState, string) (image.Layer, bool, error) {
	return image.Layer{}, false, errLinuxOnly
}

type copySpec struct {
	srcs         []string
	dest, from   string
	chown, chmod string
	add          bool
}

func (bd *builder) copyStep(context.Context, *stageState, copySpec, string) (bool, error) {
	return false, errLinuxOnly
}
