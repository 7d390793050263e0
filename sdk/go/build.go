package opendsec

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// Aliases of the build messages.
type (
	// BuildEvent is one message of a build: a step's start or end, or
	// output of a RUN step.
	BuildEvent = opendsecv1.BuildImageResponse
	// BuildStep is a step's start (Done false) or end.
	BuildStep = opendsecv1.BuildStep
	// BuildLog is output of a RUN step.
	BuildLog = opendsecv1.BuildLog
)

// BuildOptions changes BuildImage.
type BuildOptions struct {
	// Dockerfile is the Dockerfile's text; empty reads DockerfilePath.
	Dockerfile string
	// DockerfilePath is read when Dockerfile is empty; empty means
	// ContextDir/Dockerfile.
	DockerfilePath string
	// ContextDir is the build context, uploaded (as a tar) before the
	// build; empty is no context.
	ContextDir string
	// BuildArgs override ARG defaults.
	BuildArgs map[string]string
	// Target is the stage to build; empty means the last.
	Target string
	// NoCache runs every step even when the build cache has it.
	NoCache bool
	// Timeout bounds the whole build on the node; 0 is the node's default.
	Timeout time.Duration
	// StartCmd and ReadyCmd are kept in the image's config.
	StartCmd, ReadyCmd string
	// Progress, when set, is called with each step and output message.
	Progress func(*BuildEvent)
}

// BuildImage builds the image name from a Dockerfile on a node: it uploads
// opts.ContextDir, then streams the build. A failed build returns its
// error (with the failing step's last output) and changes no image.
func (c *Client) BuildImage(ctx context.Context, name string, opts *BuildOptions) (*Image, error) {
	if strings.TrimSpace(name) == "" {
		return nil, invalid("name", "is empty; name the image to build, e.g. team/app:v1")
	}
	if opts == nil {
		opts = &BuildOptions{}
	}
	df := opts.Dockerfile
	if df == "" {
		p := opts.DockerfilePath
		if p == "" {
			if opts.ContextDir == "" {
				return nil, invalid("dockerfile", "is empty; give Dockerfile, DockerfilePath or a ContextDir with a Dockerfile")
			}
			p = filepath.Join(opts.ContextDir, "Dockerfile")
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, invalid("dockerfile", "%v", err)
		}
		df = string(b)
	}
	var ctxID string
	if opts.ContextDir != "" {
		id, _, err := c.UploadBuildContext(ctx, opts.ContextDir)
		if err != nil {
			return nil, err
		}
		ctxID = id
	}
	st, err := c.images.BuildImage(ctx, connect.NewRequest(&opendsecv1.BuildImageRequest{
		Name: name, Dockerfile: df, ContextId: ctxID, BuildArgs: opts.BuildArgs, Target: opts.Target,
		NoCache: opts.NoCache, TimeoutSeconds: int64(opts.Timeout / time.Second), StartCmd: opts.StartCmd, ReadyCmd: opts.ReadyCmd,
	}))
	if err != nil {
		return nil, convertError(err)
	}
	defer st.Close()
	var img *Image
	for st.Receive() {
		m := st.Msg()
		if i := m.GetImage(); i != nil {
			img = i
			continue
		}
		if opts.Progress != nil {
			opts.Progress(m)
		}
	}
	if err := st.Err(); err != nil {
		return nil, convertError(err)
	}
	if img == nil {
		return nil, &Error{Code: CodeUnavailable, Message: "build stream ended without the image; try again"}
	}
	return img, nil
}

// uploadChunk is the size of one UploadBuildContext message.
const uploadChunk = 1 << 20

// UploadBuildContext sends dir as a build context (a tar streamed in 1 MiB
// pieces, never held in memory) and returns its ID for one build. Files
// keep their modes and times; symlinks are sent as symlinks; device files
// and sockets are left out.
func (c *Client) UploadBuildContext(ctx context.Context, dir string) (string, int64, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return "", 0, invalid("context_dir", "%v", err)
	}
	if !fi.IsDir() {
		return "", 0, invalid("context_dir", "%s is not a directory", dir)
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeContextTar(ctx, dir, pw)) }()
	defer pr.Close()
	up := c.images.UploadBuildContext(ctx)
	buf := make([]byte, uploadChunk)
	for {
		n, rerr := io.ReadFull(pr, buf)
		if n > 0 {
			if err := up.Send(&opendsecv1.UploadBuildContextRequest{Data: buf[:n]}); err != nil {
				break // the server refused: CloseAndReceive says why
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			_, _ = up.CloseAndReceive()
			return "", 0, fmt.Errorf("read build context %s: %w", dir, rerr)
		}
	}
	resp, err := up.CloseAndReceive()
	if err != nil {
		return "", 0, convertError(err)
	}
	return resp.Msg.GetContextId(), resp.Msg.GetSize(), nil
}

// writeContextTar writes dir as a tar with entries relative to it.
func writeContextTar(ctx context.Context, dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.IsDir(), fi.Mode().IsRegular():
		default:
			return nil
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = "./" + filepath.ToSlash(rel)
		if rel == "." {
			hdr.Name = "./"
		} else if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
