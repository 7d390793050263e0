package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"connectrpc.com/connect"

	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/opendsec/v1/opendsecv1connect"
	"github.com/kernflux/opendsec/internal/errdefs"
)

// ImageBuildRequest is one native image build a template build makes.
type ImageBuildRequest struct {
	// Name is the image to make (e2b-tpl/<templateID>:<buildID>).
	Name string
	// Dockerfile is the generated Dockerfile.
	Dockerfile string
	// Context is the build context tar (ContextSize bytes); nil is none.
	Context     io.Reader
	ContextSize int64
	// StartCmd and ReadyCmd are kept in the image's config.
	StartCmd, ReadyCmd string
	// NoCache runs every step even when the build cache has it.
	NoCache bool
}

// BuildEvent is one progress report of a native build: a step's start or
// end (Step and Steps are 1-based over the Dockerfile's instructions,
// FROM included), or a piece of a RUN step's output (Stream set).
type BuildEvent struct {
	Step, Steps int
	Instruction string
	Done        bool
	Cached      bool
	Stream      string
	Data        []byte
}

// ImageBuilder runs native image builds (internal/imagebuild through the
// image service) for template builds. Calls carry the principal's token.
type ImageBuilder interface {
	// BuildImage builds req, calling emit with its progress; on error
	// nothing was made.
	BuildImage(ctx context.Context, req ImageBuildRequest, emit func(BuildEvent)) error
	// RemoveImage removes an image a template build made.
	RemoveImage(ctx context.Context, name string) error
}

// NewImageBuilder is the ImageBuilder of OpenDsec's image service.
func NewImageBuilder(c opendsecv1connect.ImageServiceClient) ImageBuilder {
	return serviceBuilder{c: c}
}

type serviceBuilder struct {
	c opendsecv1connect.ImageServiceClient
}

func (s serviceBuilder) BuildImage(ctx context.Context, req ImageBuildRequest, emit func(BuildEvent)) error {
	ctxID := ""
	if req.Context != nil {
		up := s.c.UploadBuildContext(ctx)
		buf := make([]byte, 1<<20)
		first := true
		for {
			n, err := req.Context.Read(buf)
			if n > 0 {
				m := &v1.UploadBuildContextRequest{Data: append([]byte(nil), buf[:n]...)}
				if first {
					m.Size, first = req.ContextSize, false
				}
				if serr := up.Send(m); serr != nil {
					break // CloseAndReceive says why
				}
			}
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				_, _ = up.CloseAndReceive()
				return fmt.Errorf("read build context: %w", err)
			}
		}
		resp, err := up.CloseAndReceive()
		if err != nil {
			return errdefs.FromConnect(err)
		}
		ctxID = resp.Msg.GetContextId()
	}
	st, err := s.c.BuildImage(ctx, connect.NewRequest(&v1.BuildImageRequest{
		Name: req.Name, Dockerfile: req.Dockerfile, ContextId: ctxID, StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd, NoCache: req.NoCache,
	}))
	if err != nil {
		return errdefs.FromConnect(err)
	}
	defer st.Close()
	for st.Receive() {
		switch ev := st.Msg().GetEvent().(type) {
		case *v1.BuildImageResponse_Step:
			emit(BuildEvent{Step: int(ev.Step.GetIndex()), Steps: int(ev.Step.GetTotal()), Instruction: ev.Step.GetInstruction(),
				Done: ev.Step.GetDone(), Cached: ev.Step.GetCached()})
		case *v1.BuildImageResponse_Log:
			emit(BuildEvent{Step: int(ev.Log.GetStep()), Stream: ev.Log.GetStream(), Data: ev.Log.GetData()})
		}
	}
	return errdefs.FromConnect(st.Err())
}

func (s serviceBuilder) RemoveImage(ctx context.Context, name string) error {
	_, err := s.c.RemoveImage(ctx, connect.NewRequest(&v1.RemoveImageRequest{Name: name}))
	if err = errdefs.FromConnect(err); errdefs.IsNotFound(err) {
		return nil
	}
	return err
}

// fileSize is the size of an open file.
func fileSize(f *os.File) (int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}
