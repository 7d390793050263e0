package node

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"

	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
	"github.com/kernflux/opendsec/api/gen/process"
	"github.com/kernflux/opendsec/api/gen/process/processconnect"
	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/imagebuild"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
	"github.com/kernflux/opendsec/internal/sandboxid"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// BuildConfig configures image builds on the node (node.build).
type BuildConfig struct {
	// Timeout bounds a build that asks for none; MaxTimeout is the most
	// one may ask for. 0 means 30 minutes and 6 hours.
	Timeout, MaxTimeout time.Duration
	// MaxContextBytes bounds an uploaded build context; 0 means 512 MiB.
	MaxContextBytes int64
	// RuleSets are the named network rule sets a build sandbox may reach;
	// none means no network at all.
	RuleSets []string
	// CPU, MemoryMB, DiskMB size a build sandbox (0: the defaults).
	CPU      float64
	MemoryMB int64
	DiskMB   int64
}

func (c BuildConfig) timeout(asked int64) (time.Duration, error) {
	def, max := c.Timeout, c.MaxTimeout
	if def <= 0 {
		def = 30 * time.Minute
	}
	if max <= 0 {
		max = 6 * time.Hour
	}
	if asked < 0 {
		return 0, errdefs.Invalid("timeout_seconds", "is %d; give seconds, or 0 for the node's default (%s)", asked, def)
	}
	if asked == 0 {
		return def, nil
	}
	d := time.Duration(asked) * time.Second
	if d > max {
		return 0, errdefs.Invalid("timeout_seconds", "is %d; this node allows at most %d (node.build.max_timeout_sec)", asked, int64(max/time.Second))
	}
	return d, nil
}

func (c BuildConfig) maxContext() int64 {
	if c.MaxContextBytes <= 0 {
		return 512 << 20
	}
	return c.MaxContextBytes
}

// buildContextTTL is how long an uploaded context waits for its build.
const buildContextTTL = time.Hour

// contextDir is where uploaded build contexts wait: <id>.tar and
// <id>.json (its owner).
func (n *Node) contextDir() string { return filepath.Join(n.cfg.StateDir, "build-contexts") }

type contextMeta struct {
	Owner   string `json:"owner"`
	Project string `json:"project"`
	Size    int64  `json:"size"`
}

// UploadBuildContext stores a streamed context tar on this node, at most
// Build.MaxContextBytes, and returns its ID (a sandbox-shaped ID starting
// with the node's, so the apiserver routes the build here).
func (s *imageService) UploadBuildContext(ctx context.Context, stream *connect.ClientStream[opendsecv1.UploadBuildContextRequest]) (*connect.Response[opendsecv1.UploadBuildContextResponse], error) {
	n := s.n
	end, err := n.begin("upload build context")
	if err != nil {
		return nil, err
	}
	defer end()
	dir := n.contextDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("build contexts: %w", err)
	}
	n.sweepContexts(ctx)
	limit := n.cfg.Build.maxContext()
	tooBig := func(size int64) error {
		return errdefs.New(errdefs.ErrResourceExhausted, "build context: %d bytes is more than this node accepts (%d MiB, node.build.max_context_mb); leave large files out of the context (.dockerignore) or raise the limit", size, limit>>20)
	}
	f, err := os.CreateTemp(dir, ".upload-*")
	if err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	defer func() {
		f.Close()
		os.Remove(f.Name())
	}()
	var size int64
	for stream.Receive() {
		m := stream.Msg()
		if m.GetSize() > limit {
			return nil, tooBig(m.GetSize())
		}
		size += int64(len(m.GetData()))
		if size > limit {
			return nil, tooBig(size)
		}
		if _, err := f.Write(m.GetData()); err != nil {
			return nil, fmt.Errorf("build context: %w", err)
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	id := sandboxid.New(n.cfg.ID)
	owner, project := ownerOf(ctx)
	meta, _ := json.Marshal(contextMeta{Owner: owner, Project: project, Size: size})
	if err := os.WriteFile(filepath.Join(dir, id+".json"), meta, 0o600); err != nil {
		return nil, fmt.Errorf("build context: %w", err)
	}
	if err := os.Rename(f.Name(), filepath.Join(dir, id+".tar")); err != nil {
		os.Remove(filepath.Join(dir, id+".json"))
		return nil, fmt.Errorf("build context: %w", err)
	}
	log.G(ctx).Info("build context uploaded", "context_id", id, "size", size)
	return connect.NewResponse(&opendsecv1.UploadBuildContextResponse{ContextId: id, Size: size}), nil
}

// sweepContexts removes contexts nobody built within buildContextTTL.
func (n *Node) sweepContexts(ctx context.Context) {
	ents, _ := os.ReadDir(n.contextDir())
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > buildContextTTL {
			if err := os.RemoveAll(filepath.Join(n.contextDir(), e.Name())); err != nil {
				log.G(ctx).Warn("remove stale build context", "name", e.Name(), log.Err(err))
			}
		}
	}
}

// takeContext claims context id for one build: it is extracted into a
// directory the returned cleanup removes, with the upload.
func (n *Node) takeContext(ctx context.Context, id string) (string, func(), error) {
	if _, err := sandboxid.Node("context_id", id); err != nil {
		return "", nil, err
	}
	base := filepath.Join(n.contextDir(), id)
	raw, err := os.ReadFile(base + ".json")
	var meta contextMeta
	if err == nil {
		err = json.Unmarshal(raw, &meta)
	}
	c := callerOf(ctx)
	if err != nil || !c.owns(&record{Owner: meta.Owner, Project: meta.Project}) {
		return "", nil, errdefs.New(errdefs.ErrNotFound, "context_id: build context %s not found (contexts are kept for %s after their upload, for one build); upload it again", id, buildContextTTL)
	}
	tarPath := base + ".tar"
	dir := base + ".d"
	cleanup := func() {
		for _, p := range []string{dir, tarPath, base + ".json"} {
			if err := os.RemoveAll(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				log.G(ctx).Warn("remove build context", "path", p, log.Err(err))
			}
		}
	}
	f, err := os.Open(tarPath)
	if err != nil {
		cleanup()
		return "", nil, errdefs.New(errdefs.ErrNotFound, "context_id: build context %s not found; upload it again", id)
	}
	defer f.Close()
	if err := os.Mkdir(dir, 0o700); err != nil {
		cleanup()
		return "", nil, errdefs.New(errdefs.ErrFailedPrecondition, "context_id: build context %s is already being built; upload it again for another build", id)
	}
	if meta.Size > 0 {
		if err := image.ExtractTar(ctx, f, dir); err != nil {
			cleanup()
			return "", nil, errdefs.Invalid("context_id", "the uploaded context is not a valid tar: %s", errdefs.PublicMessage(err))
		}
	}
	return dir, cleanup, nil
}

// buildTimeoutCause ends a build's context when its timeout passes.
type buildTimeoutCause struct{ d time.Duration }

func (e buildTimeoutCause) Error() string { return fmt.Sprintf("build timed out after %s", e.d) }

// BuildImage builds an image from a Dockerfile, streaming steps and output.
func (s *imageService) BuildImage(ctx context.Context, req *connect.Request[opendsecv1.BuildImageRequest], stream *connect.ServerStream[opendsecv1.BuildImageResponse]) error {
	if s.store == nil {
		return errNoStore
	}
	n := s.n
	m := req.Msg
	if err := notSnapshotName("name", m.GetName()); err != nil {
		return err
	}
	if strings.TrimSpace(m.GetName()) == "" {
		return errdefs.Invalid("name", "is empty; name the image to build, e.g. team/app:v1")
	}
	timeout, err := n.cfg.Build.timeout(m.GetTimeoutSeconds())
	if err != nil {
		return err
	}
	end, err := n.begin("build image " + m.GetName())
	if err != nil {
		return err
	}
	defer end()
	ctxDir := ""
	if id := m.GetContextId(); id != "" {
		dir, cleanup, err := n.takeContext(ctx, id)
		if err != nil {
			return err
		}
		defer cleanup()
		ctxDir = dir
	}
	bctx, cancel := context.WithTimeoutCause(ctx, timeout, buildTimeoutCause{timeout})
	defer cancel()
	owner, project := ownerOf(ctx)
	var sendErr error
	send := func(r *opendsecv1.BuildImageResponse) {
		if sendErr == nil {
			if sendErr = stream.Send(r); sendErr != nil {
				cancel()
			}
		}
	}
	emit := func(e imagebuild.Event) {
		if e.Stream != "" {
			send(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Log{Log: &opendsecv1.BuildLog{Step: int32(e.Step), Stream: e.Stream, Data: e.Data}}})
			return
		}
		send(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Step{Step: &opendsecv1.BuildStep{
			Index: int32(e.Step), Total: int32(e.Steps), Instruction: e.Instruction, Done: e.Done, Cached: e.Cached, DurationMs: e.Duration.Milliseconds(),
		}}})
	}
	img, err := imagebuild.Build(bctx, s.store, &buildRunner{n: n, owner: owner, project: project}, imagebuild.Request{
		Name: m.GetName(), Dockerfile: []byte(m.GetDockerfile()), ContextDir: ctxDir, BuildArgs: m.GetBuildArgs(),
		Target: m.GetTarget(), NoCache: m.GetNoCache(), StartCmd: m.GetStartCmd(), ReadyCmd: m.GetReadyCmd(),
		Source: "dockerfile:" + m.GetName(),
	}, emit)
	if err != nil {
		var tc buildTimeoutCause
		if errors.As(context.Cause(bctx), &tc) && ctx.Err() == nil {
			return errdefs.New(errdefs.ErrDeadlineExceeded, "build timed out after %s (timeout_seconds; node default node.build.timeout_sec): %s", timeout, errdefs.PublicMessage(err))
		}
		if sendErr != nil {
			return sendErr
		}
		return err
	}
	if sendErr != nil {
		return sendErr
	}
	return stream.Send(&opendsecv1.BuildImageResponse{Event: &opendsecv1.BuildImageResponse_Image{Image: ImageToProto(img)}})
}

// buildRunner runs RUN steps in build sandboxes made by the node's own
// create pipeline (admission, network policy, limits, records), from the
// build's layers instead of an image in the store.
type buildRunner struct {
	n              *Node
	owner, project string
}

// BuildSandboxLabel marks build sandboxes.
const BuildSandboxLabel = "opendsec.build"

func (r *buildRunner) Run(ctx context.Context, spec imagebuild.RunSpec, pack func(ctx context.Context, upper string) error) (int, error) {
	n := r.n
	bc := n.cfg.Build
	id := sandboxid.New(n.cfg.ID)
	sp := specRecord{
		Image: spec.Rootfs.Image, CPU: bc.CPU, MemoryMB: bc.MemoryMB, DiskMB: bc.DiskMB,
		TimeoutSec: int64((bc.MaxTimeout + time.Minute) / time.Second), User: spec.User, Workdir: spec.Workdir,
		Labels: map[string]string{BuildSandboxLabel: "true"},
	}
	if sp.TimeoutSec < 60 {
		sp.TimeoutSec = 6*3600 + 60
	}
	if n.cfg.Network != nil && len(bc.RuleSets) > 0 {
		sp.Network = &sandboxspec.NetworkRules{RuleSets: bc.RuleSets}
	}
	img := runtime.Image{Rootfs: spec.Rootfs, Env: spec.Env, Workdir: spec.Workdir, User: spec.User}
	if _, err := n.Create(ctx, CreateRequest{ID: id, Spec: sp, SkipPool: true, Owner: r.owner, Project: r.project, prebuilt: &img}); err != nil {
		return 0, fmt.Errorf("start build sandbox: %w", err)
	}
	defer func() {
		if err := n.Stop(context.WithoutCancel(ctx), id, "build step ended"); err != nil {
			log.G(ctx).Warn("stop build sandbox", log.SandboxID(id), log.Err(err))
		}
	}()
	sb, err := n.get(id)
	if err != nil {
		return 0, err
	}
	code, err := n.runInSandbox(ctx, sb, spec)
	if err != nil || code != 0 {
		return code, err
	}
	d, ok := n.cfg.Backends[sb.backend].(runtime.RootfsDiffer)
	if !ok {
		return 0, errdefs.New(errdefs.ErrUnimplemented, "the %s backend cannot hand out a sandbox's changes, so it cannot run build steps", sb.backend)
	}
	err = d.DiffRootfs(ctx, id, func(ctx context.Context, diff runtime.RootfsDiff) error {
		if diff.Format != runtime.DiffOverlayDir {
			return errdefs.New(errdefs.ErrUnimplemented, "the %s backend hands out its changes as %q, which a build cannot read", sb.backend, diff.Format)
		}
		return pack(ctx, diff.Dir)
	})
	return 0, err
}

// runInSandbox runs spec's command through the sandbox's agent, copying
// its output, and returns its exit code.
func (n *Node) runInSandbox(ctx context.Context, sb *sandbox, spec imagebuild.RunSpec) (int, error) {
	if len(spec.Args) == 0 {
		return 0, errdefs.Invalid("dockerfile", "RUN has no command")
	}
	c := processconnect.NewProcessClient(&http.Client{Transport: n.agentTransport(sb)}, "http://agent")
	noStdin := false
	cwd := spec.Workdir
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: spec.Args[0], Args: spec.Args[1:], Cwd: &cwd},
		Stdin:   &noStdin,
	})
	if spec.User != "" {
		req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(spec.User+":")))
	}
	st, err := c.Start(ctx, req)
	if err != nil {
		return 0, fmt.Errorf("run build step: %w", err)
	}
	defer st.Close()
	code, ended := 0, false
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			if b := d.GetStdout(); len(b) > 0 {
				_, _ = spec.Stdout.Write(b)
			}
			if b := d.GetStderr(); len(b) > 0 {
				_, _ = spec.Stderr.Write(b)
			}
		}
		if e := ev.GetEnd(); e != nil {
			code, ended = int(e.GetExitCode()), true
			if !e.GetExited() && code == 0 {
				code = -1
			}
		}
	}
	if err := st.Err(); err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		return 0, errdefs.FromConnect(err)
	}
	if !ended {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		return 0, errdefs.New(errdefs.ErrUnavailable, "the build step's process stream ended without its exit status")
	}
	return code, nil
}
