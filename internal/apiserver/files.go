package apiserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/kernflux/opendsec/api/gen/filesystem"
	v1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/nodeclient"
	"github.com/kernflux/opendsec/internal/trajectory"
)

func fileInfo(e *filesystem.EntryInfo) *v1.FileInfo {
	if e == nil {
		return nil
	}
	return &v1.FileInfo{
		Name:          e.GetName(),
		Path:          e.GetPath(),
		Type:          v1.FileType(e.GetType()),
		Size:          e.GetSize(),
		Mode:          e.GetMode(),
		Owner:         e.GetOwner(),
		Group:         e.GetGroup(),
		ModifiedAt:    e.GetModifiedTime(),
		SymlinkTarget: e.GetSymlinkTarget(),
	}
}

// filesURL is the agent's /files endpoint for p as user.
func (a *agent) filesURL(p, user string) string {
	q := url.Values{"path": {p}}
	if user != "" {
		q.Set("username", user)
	}
	u := a.node.AgentURL(a.id, "/files")
	u.RawQuery = q.Encode()
	return u.String()
}

// ReadFile streams a file from GET /files in 1 MiB chunks.
func (s *Server) ReadFile(ctx context.Context, req *connect.Request[v1.ReadFileRequest], stream *connect.ServerStream[v1.ReadFileResponse]) error {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return err
	}
	if err := firstErr(checkPath("path", req.Msg.GetPath()), validateUser("user", req.Msg.GetUser())); err != nil {
		return err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, a.filesURL(req.Msg.GetPath(), req.Msg.GetUser()), nil)
	if err != nil {
		return fmt.Errorf("read file request: %w", err)
	}
	resp, err := a.node.HTTPClient().Do(hreq)
	if err != nil {
		return ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read file: %s", err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nodeclient.MapResponse(resp, "read file")
	}
	buf := make([]byte, readChunk)
	for {
		n, err := io.ReadFull(resp.Body, buf)
		if n > 0 {
			if serr := stream.Send(&v1.ReadFileResponse{Data: buf[:n]}); serr != nil {
				return serr
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
			return nil
		default:
			return ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "read file: %s", err))
		}
	}
}

// WriteFile takes a header then data chunks. The bytes go to a temporary
// file next to the target through POST /files, streamed through a pipe,
// and are moved over the target only when all arrived within the upload
// limit: a failed or oversized upload leaves nothing behind.
func (s *Server) WriteFile(ctx context.Context, stream *connect.ClientStream[v1.WriteFileRequest]) (*connect.Response[v1.WriteFileResponse], error) {
	if !stream.Receive() {
		if err := stream.Err(); err != nil {
			return nil, err
		}
		return nil, errdefs.Invalid("header", "is missing; send {sandbox_id, path} first, then data")
	}
	h := stream.Msg().GetHeader()
	if h == nil {
		return nil, errdefs.Invalid("header", "the first message must be the header {sandbox_id, path}; data comes after it")
	}
	a, err := s.agentFor(ctx, h.GetSandboxId())
	if err != nil {
		return nil, err
	}
	limit := s.cfg.MaxUploadBytes
	switch {
	case h.GetSize() < 0:
		err = errdefs.Invalid("size", "%d must be ≥ 0 (0 means unknown)", h.GetSize())
	case h.GetSize() > limit:
		err = sizeLimitErr(h.GetSize(), limit)
	default:
		err = firstErr(checkPath("path", h.GetPath()), validateUser("user", h.GetUser()))
	}
	if err != nil {
		return nil, err
	}
	entry, err := s.upload(ctx, a, h, stream)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.WriteFileResponse{File: fileInfo(entry)}), nil
}

func (s *Server) upload(ctx context.Context, a *agent, h *v1.WriteFileHeader, stream *connect.ClientStream[v1.WriteFileRequest]) (*filesystem.EntryInfo, error) {
	limit := s.cfg.MaxUploadBytes
	suffix := make([]byte, 8)
	_, _ = rand.Read(suffix)
	tmp := path.Join(path.Dir(h.GetPath()), ".opendsec-upload-"+hex.EncodeToString(suffix))

	pr, pw := io.Pipe()
	type result struct {
		resp *http.Response
		err  error
	}
	done := make(chan result, 1)
	// The upload outlives a failed request by a little: on every failure
	// the body is ended cleanly, so the agent finishes writing the
	// temporary file and answers before we remove it (removing it while
	// the agent may still create it would race). Only a stuck agent is cut
	// off, 30s after the caller went away.
	uctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stopGuard := context.AfterFunc(ctx, func() { time.AfterFunc(30*time.Second, cancel) })
	defer stopGuard()
	go func() {
		hreq, err := http.NewRequestWithContext(uctx, http.MethodPost, a.filesURL(tmp, h.GetUser()), pr)
		if err != nil {
			pr.CloseWithError(err)
			done <- result{err: err}
			return
		}
		hreq.Header.Set("Content-Type", "application/octet-stream")
		// The node's trajectory log records the write under the path
		// the caller asked for, not the temporary file.
		hreq.Header.Set(trajectory.FilePathHeader, h.GetPath())
		resp, err := a.node.HTTPClient().Do(hreq)
		// The agent may answer before reading everything (an error):
		// unblock the writer.
		pr.CloseWithError(errors.New("upload ended"))
		done <- result{resp, err}
	}()
	finish := func() result {
		r := <-done
		if r.resp != nil {
			defer r.resp.Body.Close()
			if r.resp.StatusCode != http.StatusOK {
				r.err = nodeclient.MapResponse(r.resp, "write file")
				// The agent names the temporary file it was asked to
				// write; the caller knows only their own path.
				if msg := errdefs.PublicMessage(r.err); strings.Contains(msg, tmp) {
					r.err = errdefs.WithPublic(r.err, "%s", strings.ReplaceAll(msg, tmp, h.GetPath()))
				}
			}
		} else if r.err != nil {
			r.err = ctxErr(ctx, errdefs.New(errdefs.ErrUnavailable, "write file: %s", r.err))
		}
		return r
	}
	fail := func(err error) (*filesystem.EntryInfo, error) {
		pw.Close()
		finish()
		s.removeQuietly(ctx, a, tmp, h.GetUser())
		return nil, err
	}

	var total int64
	writeFailed := false
	for !writeFailed && stream.Receive() {
		msg := stream.Msg()
		if msg.GetHeader() != nil {
			return fail(errdefs.Invalid("header", "only the first message may be the header"))
		}
		data := msg.GetData()
		total += int64(len(data))
		if total > limit {
			return fail(errdefs.New(errdefs.ErrResourceExhausted, "size: more than %d bytes arrived, over the upload limit of %d bytes (%d MiB, node.max_upload_mb); split the file", limit, limit, limit>>20))
		}
		if _, err := pw.Write(data); err != nil {
			writeFailed = true // the upload ended early; its result says why
		}
	}
	if err := stream.Err(); err != nil {
		return fail(ctxErr(ctx, err))
	}
	if !writeFailed && h.GetSize() > 0 && total != h.GetSize() {
		// When the agent refused the write itself (permission, a reserved
		// path), that is the reason: the Python SDK asks with the header
		// alone to learn why an upload was cut off (grpcio loses the
		// status, grpc/grpc#36066).
		pw.Close()
		r := finish()
		s.removeQuietly(ctx, a, tmp, h.GetUser())
		if r.err != nil {
			return nil, r.err
		}
		return nil, errdefs.Invalid("size", "header says %d bytes but %d arrived", h.GetSize(), total)
	}
	pw.Close()
	r := finish()
	if r.err == nil && writeFailed {
		r.err = errdefs.New(errdefs.ErrUnavailable, "write file: the agent ended the upload before all data arrived")
	}
	if r.err != nil {
		s.removeQuietly(ctx, a, tmp, h.GetUser())
		return nil, r.err
	}
	mreq := connect.NewRequest(&filesystem.MoveRequest{Source: tmp, Destination: h.GetPath()})
	setUser(mreq.Header(), h.GetUser())
	resp, err := a.fs.Move(ctx, mreq)
	if err != nil {
		s.removeQuietly(ctx, a, tmp, h.GetUser())
		return nil, a.agentErr(ctx, "move upload into place", err)
	}
	return resp.Msg.GetEntry(), nil
}

func (s *Server) removeQuietly(ctx context.Context, a *agent, p, user string) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	req := connect.NewRequest(&filesystem.RemoveRequest{Path: p})
	setUser(req.Header(), user)
	if _, err := a.fs.Remove(rctx, req); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
		log.G(ctx).Warn("remove partial upload", log.SandboxID(a.id), log.Err(err))
	}
}

// ListDir lists a directory to depth levels (0 means 1).
func (s *Server) ListDir(ctx context.Context, req *connect.Request[v1.ListDirRequest]) (*connect.Response[v1.ListDirResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPath("path", req.Msg.GetPath()), validateUser("user", req.Msg.GetUser())); err != nil {
		return nil, err
	}
	depth := max(req.Msg.GetDepth(), 1)
	if depth > 64 {
		return nil, errdefs.Invalid("depth", "%d is too deep; at most 64", depth)
	}
	r := connect.NewRequest(&filesystem.ListDirRequest{Path: req.Msg.GetPath(), Depth: depth})
	setUser(r.Header(), req.Msg.GetUser())
	resp, err := a.fs.ListDir(ctx, r)
	if err != nil {
		return nil, a.agentErr(ctx, "list dir", err)
	}
	out := &v1.ListDirResponse{}
	for _, e := range resp.Msg.GetEntries() {
		out.Entries = append(out.Entries, fileInfo(e))
	}
	return connect.NewResponse(out), nil
}

// Stat describes one path.
func (s *Server) Stat(ctx context.Context, req *connect.Request[v1.StatRequest]) (*connect.Response[v1.StatResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPath("path", req.Msg.GetPath()), validateUser("user", req.Msg.GetUser())); err != nil {
		return nil, err
	}
	e, err := a.stat(ctx, req.Msg.GetPath(), req.Msg.GetUser())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.StatResponse{File: fileInfo(e)}), nil
}

func (a *agent) stat(ctx context.Context, p, user string) (*filesystem.EntryInfo, error) {
	r := connect.NewRequest(&filesystem.StatRequest{Path: p})
	setUser(r.Header(), user)
	resp, err := a.fs.Stat(ctx, r)
	if err != nil {
		return nil, a.agentErr(ctx, "stat", err)
	}
	return resp.Msg.GetEntry(), nil
}

// Remove deletes a path recursively; a missing path is not an error.
func (s *Server) Remove(ctx context.Context, req *connect.Request[v1.RemoveRequest]) (*connect.Response[v1.RemoveResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPath("path", req.Msg.GetPath()), validateUser("user", req.Msg.GetUser())); err != nil {
		return nil, err
	}
	r := connect.NewRequest(&filesystem.RemoveRequest{Path: req.Msg.GetPath()})
	setUser(r.Header(), req.Msg.GetUser())
	if _, err := a.fs.Remove(ctx, r); err != nil {
		return nil, a.agentErr(ctx, "remove", err)
	}
	return connect.NewResponse(&v1.RemoveResponse{}), nil
}

// MakeDir creates a directory and its parents; created is false when it
// already existed.
func (s *Server) MakeDir(ctx context.Context, req *connect.Request[v1.MakeDirRequest]) (*connect.Response[v1.MakeDirResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPath("path", req.Msg.GetPath()), validateUser("user", req.Msg.GetUser())); err != nil {
		return nil, err
	}
	r := connect.NewRequest(&filesystem.MakeDirRequest{Path: req.Msg.GetPath()})
	setUser(r.Header(), req.Msg.GetUser())
	resp, err := a.fs.MakeDir(ctx, r)
	if connect.CodeOf(err) == connect.CodeAlreadyExists {
		e, err := a.stat(ctx, req.Msg.GetPath(), req.Msg.GetUser())
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&v1.MakeDirResponse{File: fileInfo(e), Created: false}), nil
	}
	if err != nil {
		return nil, a.agentErr(ctx, "make dir", err)
	}
	return connect.NewResponse(&v1.MakeDirResponse{File: fileInfo(resp.Msg.GetEntry()), Created: true}), nil
}

// Move renames source to destination, creating destination's parents.
func (s *Server) Move(ctx context.Context, req *connect.Request[v1.MoveRequest]) (*connect.Response[v1.MoveResponse], error) {
	a, err := s.agentFor(ctx, req.Msg.GetSandboxId())
	if err != nil {
		return nil, err
	}
	if err := firstErr(checkPath("source", req.Msg.GetSource()), checkPath("destination", req.Msg.GetDestination()), validateUser("user", req.Msg.GetUser())); err != nil {
		return nil, err
	}
	r := connect.NewRequest(&filesystem.MoveRequest{Source: req.Msg.GetSource(), Destination: req.Msg.GetDestination()})
	setUser(r.Header(), req.Msg.GetUser())
	resp, err := a.fs.Move(ctx, r)
	if err != nil {
		return nil, a.agentErr(ctx, "move", err)
	}
	return connect.NewResponse(&v1.MoveResponse{File: fileInfo(resp.Msg.GetEntry())}), nil
}
