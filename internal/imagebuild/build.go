// Package imagebuild builds images from Dockerfiles into the shared image
// store. Dockerfiles are parsed with BuildKit's parser; each RUN runs in a
// build sandbox (a Runner, the node's container backend), whose writable
// layer becomes one new layer; COPY, ADD and WORKDIR make their layers on
// the host. Every layer-making step is cached by content: its key is the
// chain of layers under it, the instruction with its expanded arguments and
// state (env, user, workdir), and the hashes of the context files it reads.
// Nothing reaches the store until the whole build succeeded.
package imagebuild

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/log"
	"github.com/kernflux/opendsec/internal/runtime"
)

// MaxDockerfileBytes bounds a Dockerfile.
const MaxDockerfileBytes = 1 << 20

// defaultPath is the PATH a RUN gets when the image sets none (Docker's).
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Request is one build.
type Request struct {
	// Name is the image to make ("team/app:v1").
	Name string
	// Dockerfile is the Dockerfile's text.
	Dockerfile []byte
	// ContextDir is the build context on this host (COPY and ADD read
	// from it); empty means an empty context.
	ContextDir string
	// BuildArgs override ARG defaults.
	BuildArgs map[string]string
	// Target is the stage to build; empty means the last.
	Target string
	// NoCache runs every step even when the cache has it.
	NoCache bool
	// StartCmd and ReadyCmd are kept in the image's config.
	StartCmd, ReadyCmd string
	// Source is recorded as the image's source.
	Source string
}

// Event is one progress report of a build.
type Event struct {
	// Step is 1-based over Steps (every instruction of the stages built).
	Step, Steps int
	// Instruction is the step's text ("RUN make"), on its start and end.
	Instruction string
	// Started, Done: the step began, or ended (Cached: from the cache).
	Started, Done, Cached bool
	Duration              time.Duration
	// Stream and Data carry a RUN step's output ("stdout" or "stderr").
	Stream string
	Data   []byte
}

// RunSpec is one RUN step for a Runner.
type RunSpec struct {
	// Rootfs is the step's root filesystem (read-only layers); the runner
	// adds a writable layer on top.
	Rootfs runtime.Rootfs
	// Env is K=V; User and Workdir as in the image config.
	Env           []string
	User, Workdir string
	// Args is the command (argv).
	Args           []string
	Stdout, Stderr io.Writer
}

// Runner runs RUN steps in build sandboxes.
type Runner interface {
	// Run runs spec's command in a new sandbox and, when it exits 0,
	// calls pack with the sandbox's overlayfs upper directory while the
	// sandbox still exists; the sandbox is gone when Run returns. It
	// returns the command's exit code. It stops the command when ctx ends.
	Run(ctx context.Context, spec RunSpec, pack func(ctx context.Context, upper string) error) (exitCode int, err error)
}

// scrubPaths are what a build sandbox leaves in its writable layer that is
// not the step's work: the mount points of OpenDsec's own files.
var scrubPaths = []string{".opendsec", "run/opendsec", "etc/resolv.conf"}

// stageState is a stage's image while it is built.
type stageState struct {
	name   string
	layers []image.Layer
	cfg    image.Config
	args   map[string]string // ARGs in scope, with values
	shell  []string
	done   bool
}

// builder runs one build.
type builder struct {
	req    Request
	store  *image.Store
	b      *image.Build
	run    Runner
	emit   func(Event)
	lex    *shell.Lex
	stages []*stageState
	step   int
	steps  int
}

// Build builds req into store, calling emit (from this goroutine) with
// progress and output. Errors name the Dockerfile line; on error the store
// is unchanged.
func Build(ctx context.Context, store *image.Store, run Runner, req Request, emit func(Event)) (image.Image, error) {
	if emit == nil {
		emit = func(Event) {}
	}
	name, err := image.NormalizeName(req.Name)
	if err != nil {
		return image.Image{}, errdefs.Invalid("name", "%s", strings.TrimPrefix(errdefs.PublicMessage(err), "image: "))
	}
	req.Name = name
	if len(req.Dockerfile) == 0 {
		return image.Image{}, errdefs.Invalid("dockerfile", "is empty; give a Dockerfile starting with FROM")
	}
	if len(req.Dockerfile) > MaxDockerfileBytes {
		return image.Image{}, errdefs.Invalid("dockerfile", "is %d bytes; at most %d are allowed", len(req.Dockerfile), MaxDockerfileBytes)
	}
	res, err := parser.Parse(bytes.NewReader(req.Dockerfile))
	if err != nil {
		return image.Image{}, errdefs.Invalid("dockerfile", "%s", dfError(err))
	}
	stages, metaArgs, err := instructions.Parse(res.AST, nil)
	if err != nil {
		return image.Image{}, errdefs.Invalid("dockerfile", "%s", dfError(err))
	}
	if len(stages) == 0 {
		return image.Image{}, errdefs.Invalid("dockerfile", "has no FROM; start it with FROM IMAGE or FROM scratch")
	}
	last := len(stages) - 1
	if req.Target != "" {
		i, ok := instructions.HasStage(stages, req.Target)
		if !ok {
			return image.Image{}, errdefs.Invalid("target", "stage %q is not in the Dockerfile (name stages with FROM IMAGE AS NAME)", req.Target)
		}
		last = i
	}
	stages = stages[:last+1]
	bd := &builder{req: req, store: store, run: run, emit: emit, lex: shell.NewLex(res.EscapeToken)}
	if err := bd.check(stages); err != nil {
		return image.Image{}, err
	}
	for _, s := range stages {
		bd.steps += 1 + len(s.Commands)
	}
	global := map[string]string{}
	for _, ma := range metaArgs {
		for _, a := range ma.Args {
			v, set := req.BuildArgs[a.Key]
			if !set && a.Value != nil {
				var err error
				if v, err = bd.expand(*a.Value, global, nil); err != nil {
					return image.Image{}, lineErr(ma.Location(), "ARG", err)
				}
			}
			global[a.Key] = v
		}
	}
	if bd.b, err = store.NewBuild(); err != nil {
		return image.Image{}, err
	}
	defer bd.b.Close(ctx)
	t0 := time.Now()
	for i := range stages {
		if err := bd.buildStage(ctx, &stages[i], global); err != nil {
			return image.Image{}, err
		}
	}
	final := bd.stages[len(bd.stages)-1]
	if len(final.layers) == 0 {
		return image.Image{}, errdefs.Invalid("dockerfile", "the image has no files: its last stage is FROM scratch with no COPY, ADD or WORKDIR; copy something in or start FROM an image")
	}
	cfg := final.cfg
	if req.StartCmd != "" {
		cfg.StartCmd = req.StartCmd
	}
	if req.ReadyCmd != "" {
		cfg.ReadyCmd = req.ReadyCmd
	}
	src := req.Source
	if src == "" {
		src = "dockerfile"
	}
	img, err := bd.b.Commit(ctx, req.Name, final.layers, cfg, src)
	if err != nil {
		return image.Image{}, err
	}
	log.G(ctx).Info("build finished", "image", img.Name, "steps", bd.steps, "duration_ms", time.Since(t0).Milliseconds())
	return img, nil
}

// dfError is BuildKit's message for a Dockerfile error, with its line.
func dfError(err error) string {
	msg := err.Error()
	var le *parser.LocationError
	if errors.As(err, &le) && len(le.Locations) > 0 && len(le.Locations[0]) > 0 && !strings.Contains(msg, "line ") {
		msg = fmt.Sprintf("line %d: %s", le.Locations[0][0].Start.Line, msg)
	}
	if i := strings.Index(msg, "no build stage in current context"); i >= 0 {
		msg = msg[:i] + "an instruction comes before the first FROM; start the Dockerfile with FROM IMAGE or FROM scratch (only ARG may come before it)"
	}
	return msg
}

func lineOf(loc []parser.Range) int {
	if len(loc) == 0 {
		return 0
	}
	return loc[0].Start.Line
}

// lineErr names the Dockerfile line and instruction of err.
func lineErr(loc []parser.Range, instr string, err error) error {
	if errdefs.Code(err) != 0 && !errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	msg := errdefs.PublicMessage(err)
	var fe *errdefs.FieldError
	if errors.As(err, &fe) {
		msg = fe.Msg
	}
	return errdefs.Invalid("dockerfile", "line %d: %s: %s", lineOf(loc), instr, msg)
}

// check refuses what the build cannot do before anything runs: unsupported
// instructions and flags.
func (bd *builder) check(stages []instructions.Stage) error {
	for _, s := range stages {
		for _, c := range s.Commands {
			name := strings.ToUpper(c.Name())
			switch c := c.(type) {
			case *instructions.RunCommand:
				if len(c.FlagsUsed) > 0 {
					return errdefs.Invalid("dockerfile", "line %d: RUN --%s is not supported by OpenDsec builds; remove the flag", lineOf(c.Location()), c.FlagsUsed[0])
				}
				if len(c.Files) > 0 {
					return errdefs.Invalid("dockerfile", "line %d: RUN with a heredoc is not supported; write the commands inline or COPY a script", lineOf(c.Location()))
				}
			case *instructions.CopyCommand:
				if c.Parents || len(c.ExcludePatterns) > 0 || len(c.SourceContents) > 0 {
					return errdefs.Invalid("dockerfile", "line %d: COPY --parents, --exclude and heredocs are not supported; copy plain paths", lineOf(c.Location()))
				}
			case *instructions.AddCommand:
				if len(c.ExcludePatterns) > 0 || c.Checksum != "" || len(c.SourceContents) > 0 {
					return errdefs.Invalid("dockerfile", "line %d: ADD --exclude, --checksum and heredocs are not supported; copy plain paths", lineOf(c.Location()))
				}
			case *instructions.EnvCommand, *instructions.WorkdirCommand, *instructions.UserCommand,
				*instructions.ArgCommand, *instructions.CmdCommand, *instructions.EntrypointCommand,
				*instructions.LabelCommand, *instructions.ExposeCommand, *instructions.ShellCommand,
				*instructions.MaintainerCommand:
			default:
				return errdefs.Invalid("dockerfile", "line %d: %s is not supported by OpenDsec builds (supported: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT, LABEL, EXPOSE, SHELL); remove it", lineOf(c.Location()), name)
			}
		}
	}
	return nil
}

// envGetter looks names up in the stage's ARGs, then its ENV.
type envGetter struct {
	args map[string]string
	env  []string
}

func (g envGetter) Get(key string) (string, bool) {
	for i := len(g.env) - 1; i >= 0; i-- {
		if k, v, _ := strings.Cut(g.env[i], "="); k == key {
			return v, true
		}
	}
	v, ok := g.args[key]
	return v, ok
}

func (g envGetter) Keys() []string {
	var ks []string
	for k := range g.args {
		ks = append(ks, k)
	}
	for _, e := range g.env {
		k, _, _ := strings.Cut(e, "=")
		ks = append(ks, k)
	}
	return ks
}

func (bd *builder) expand(word string, args map[string]string, env []string) (string, error) {
	out, _, err := bd.lex.ProcessWord(word, envGetter{args: args, env: env})
	return out, err
}

func (bd *builder) emitStep(instr string, start time.Time, cached bool) {
	bd.emit(Event{Step: bd.step, Steps: bd.steps, Instruction: instr, Done: true, Cached: cached, Duration: time.Since(start)})
}

func (bd *builder) startStep(instr string) time.Time {
	bd.step++
	bd.emit(Event{Step: bd.step, Steps: bd.steps, Instruction: instr, Started: true})
	return time.Now()
}

// findStage returns the built stage called name (case-insensitive) or at
// index name.
func (bd *builder) findStage(name string) *stageState {
	for _, s := range bd.stages {
		if s.name != "" && strings.EqualFold(s.name, name) {
			return s
		}
	}
	var i int
	if _, err := fmt.Sscanf(name, "%d", &i); err == nil && fmt.Sprint(i) == name && i >= 0 && i < len(bd.stages) {
		return bd.stages[i]
	}
	return nil
}

func (bd *builder) buildStage(ctx context.Context, s *instructions.Stage, global map[string]string) error {
	st := &stageState{name: s.Name, args: map[string]string{}, shell: []string{"/bin/sh", "-c"}}
	base, err := bd.expand(s.BaseName, global, nil)
	if err != nil {
		return lineErr(s.Location, "FROM", err)
	}
	instr := "FROM " + base
	if s.Name != "" {
		instr += " AS " + s.Name
	}
	t := bd.startStep(instr)
	switch prev := bd.findStage(base); {
	case strings.EqualFold(base, "scratch"):
	case prev != nil:
		st.layers, st.cfg = slices.Clone(prev.layers), prev.cfg
	default:
		img, err := bd.b.BaseImage(ctx, base)
		if errdefs.IsNotFound(err) {
			return errdefs.Invalid("dockerfile", "line %d: FROM %s: no such image in the store and no earlier stage of that name; import it first (`opendsecctl image import`) or use FROM scratch", lineOf(s.Location), base)
		} else if err != nil {
			return lineErr(s.Location, "FROM", err)
		}
		st.layers, st.cfg = slices.Clone(img.Layers), img.Config
	}
	st.cfg.Env = slices.Clone(st.cfg.Env)
	bd.stages = append(bd.stages, st)
	bd.emitStep(instr, t, false)
	for _, c := range s.Commands {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := bd.command(ctx, st, c, global); err != nil {
			return err
		}
	}
	st.done = true
	return nil
}

// command runs one instruction of stage st.
func (bd *builder) command(ctx context.Context, st *stageState, c instructions.Command, global map[string]string) error {
	loc := c.Location()
	name := strings.ToUpper(c.Name())
	if ex, ok := c.(instructions.SupportsSingleWordExpansion); ok {
		if _, isRun := c.(*instructions.RunCommand); !isRun {
			if err := ex.Expand(func(w string) (string, error) { return bd.expand(w, st.args, st.cfg.Env) }); err != nil {
				return lineErr(loc, name, err)
			}
		}
	}
	instr := instructionText(c)
	t := bd.startStep(instr)
	cached := false
	var err error
	switch c := c.(type) {
	case *instructions.EnvCommand:
		for _, kv := range c.Env {
			st.cfg.Env = setEnv(st.cfg.Env, kv.Key, kv.Value)
		}
	case *instructions.ArgCommand:
		for _, a := range c.Args {
			v, set := bd.req.BuildArgs[a.Key]
			if !set {
				if gv, ok := global[a.Key]; ok && a.Value == nil {
					v = gv
				} else if a.Value != nil {
					v = *a.Value
				}
			}
			st.args[a.Key] = v
		}
	case *instructions.UserCommand:
		st.cfg.User = c.User
	case *instructions.LabelCommand:
		if st.cfg.Labels == nil {
			st.cfg.Labels = map[string]string{}
		} else {
			st.cfg.Labels = cloneMap(st.cfg.Labels)
		}
		for _, kv := range c.Labels {
			st.cfg.Labels[kv.Key] = kv.Value
		}
	case *instructions.MaintainerCommand:
		st.cfg.Labels = cloneMap(st.cfg.Labels)
		if st.cfg.Labels == nil {
			st.cfg.Labels = map[string]string{}
		}
		st.cfg.Labels["maintainer"] = c.Maintainer
	case *instructions.ExposeCommand:
		for _, p := range c.Ports {
			if !strings.Contains(p, "/") {
				p += "/tcp"
			}
			if !slices.Contains(st.cfg.ExposedPorts, p) {
				st.cfg.ExposedPorts = append(slices.Clone(st.cfg.ExposedPorts), p)
			}
		}
	case *instructions.ShellCommand:
		st.shell = slices.Clone(c.Shell)
	case *instructions.CmdCommand:
		st.cfg.Cmd = bd.cmdLine(st, c.ShellDependantCmdLine)
	case *instructions.EntrypointCommand:
		st.cfg.Entrypoint = bd.cmdLine(st, c.ShellDependantCmdLine)
		st.cfg.Cmd = nil // Docker: a new ENTRYPOINT drops the CMD it inherited
	case *instructions.WorkdirCommand:
		cached, err = bd.workdir(ctx, st, c.Path)
	case *instructions.RunCommand:
		cached, err = bd.runStep(ctx, st, c, instr)
	case *instructions.CopyCommand:
		cached, err = bd.copyStep(ctx, st, copySpec{srcs: c.SourcePaths, dest: c.DestPath, from: c.From, chown: c.Chown, chmod: c.Chmod}, instr)
	case *instructions.AddCommand:
		for _, s := range c.SourcePaths {
			if strings.Contains(s, "://") || strings.HasPrefix(s, "git@") {
				return errdefs.Invalid("dockerfile", "line %d: ADD %s: URLs are not supported (a build reaches only what the operator allows); download it in a RUN step or put it in the context", lineOf(loc), s)
			}
		}
		cached, err = bd.copyStep(ctx, st, copySpec{srcs: c.SourcePaths, dest: c.DestPath, chown: c.Chown, chmod: c.Chmod, add: true}, instr)
	}
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, errdefs.ErrDeadlineExceeded) {
			return err
		}
		return lineErr(loc, instr, err)
	}
	bd.emitStep(instr, t, cached)
	return nil
}

// instructionText is the step as shown: its source, shortened.
func instructionText(c instructions.Command) string {
	s := strings.TrimSpace(fmt.Sprint(c))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i] + " ..."
	}
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return s
}

func (bd *builder) cmdLine(st *stageState, c instructions.ShellDependantCmdLine) []string {
	if c.PrependShell {
		return append(slices.Clone(st.shell), strings.Join(c.CmdLine, " "))
	}
	return slices.Clone(c.CmdLine)
}

func setEnv(env []string, k, v string) []string {
	out := slices.DeleteFunc(slices.Clone(env), func(e string) bool { ek, _, _ := strings.Cut(e, "="); return ek == k })
	return append(out, k+"="+v)
}

func cloneMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// chain identifies a stack of layers.
func chain(layers []image.Layer) string {
	ds := make([]string, len(layers))
	for i, l := range layers {
		ds[i] = l.Digest
	}
	return strings.Join(ds, ",")
}

// cachedStep looks key up and, on a hit, applies it to st.
func (bd *builder) cachedStep(st *stageState, key string) bool {
	if bd.req.NoCache {
		return false
	}
	l, ok, found := bd.b.Cached(key)
	if !found {
		return false
	}
	if ok {
		st.layers = append(st.layers, l)
	}
	return true
}

func (bd *builder) addResult(st *stageState, key string, l image.Layer, ok bool) {
	bd.b.Remember(key, l, ok)
	if ok {
		st.layers = append(st.layers, l)
	}
}

// runEnv is a RUN's environment: the image's, the stage's ARGs (not kept
// in the image), and a PATH.
func runEnv(st *stageState) []string {
	env := slices.Clone(st.cfg.Env)
	keys := make([]string, 0, len(st.args))
	for k := range st.args {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if _, set := (envGetter{env: st.cfg.Env}).Get(k); !set {
			env = append(env, k+"="+st.args[k])
		}
	}
	if _, ok := (envGetter{env: env}).Get("PATH"); !ok {
		env = append([]string{defaultPath}, env...)
	}
	return env
}

func (bd *builder) runStep(ctx context.Context, st *stageState, c *instructions.RunCommand, instr string) (bool, error) {
	args := bd.cmdLine(st, c.ShellDependantCmdLine)
	env := runEnv(st)
	user := st.cfg.User
	if user == "" {
		user = "root"
	}
	workdir := st.cfg.Workdir
	if workdir == "" {
		workdir = "/"
	}
	argv, _ := json.Marshal(args)
	envj, _ := json.Marshal(env)
	key := image.CacheKey("run/v1", chain(st.layers), string(argv), string(envj), user, workdir)
	if bd.cachedStep(st, key) {
		return true, nil
	}
	if len(st.layers) == 0 {
		return false, errdefs.Invalid("dockerfile", "RUN needs a root filesystem with the command in it; FROM scratch has no files yet (COPY a static binary first or start FROM an image)")
	}
	rootfs, err := bd.b.Rootfs(bd.req.Name, st.layers)
	if err != nil {
		return false, err
	}
	tail := &tailBuffer{max: 4096}
	out := func(stream string) io.Writer {
		return writerFunc(func(p []byte) (int, error) {
			tail.Write(p)
			bd.emit(Event{Step: bd.step, Steps: bd.steps, Stream: stream, Data: slices.Clone(p)})
			return len(p), nil
		})
	}
	var (
		layer image.Layer
		ok    bool
	)
	bottom := len(st.layers) == 0
	code, err := bd.run.Run(ctx, RunSpec{Rootfs: rootfs, Env: env, User: user, Workdir: workdir, Args: args, Stdout: out("stdout"), Stderr: out("stderr")},
		func(ctx context.Context, upper string) error {
			var err error
			layer, ok, err = bd.b.AddUpper(ctx, upper, bottom, scrubPaths)
			return err
		})
	if err != nil {
		if ctx.Err() != nil {
			return false, errdefs.New(errdefs.ErrDeadlineExceeded, "step %d/%d %s did not finish before the build's deadline (timeout_seconds, or node.build.timeout_sec); its output ended with:\n%s", bd.step, bd.steps, instr, tail.String())
		}
		return false, err
	}
	if code != 0 {
		return false, errdefs.Invalid("dockerfile", "the command exited with code %d; its output ended with:\n%s", code, tail.String())
	}
	bd.addResult(st, key, layer, ok)
	return false, nil
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// tailBuffer keeps the last max bytes written.
type tailBuffer struct {
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) {
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = t.b[len(t.b)-t.max:]
	}
}

func (t *tailBuffer) String() string {
	if len(t.b) == 0 {
		return "(no output)"
	}
	return string(t.b)
}

// absIn makes p absolute against workdir.
func absIn(workdir, p string) string {
	if path.IsAbs(p) {
		return path.Clean(p)
	}
	if workdir == "" {
		workdir = "/"
	}
	return path.Join(workdir, p)
}

func (bd *builder) workdir(ctx context.Context, st *stageState, p string) (bool, error) {
	wd := absIn(st.cfg.Workdir, p)
	st.cfg.Workdir = wd
	if wd == "/" {
		return false, nil
	}
	key := image.CacheKey("workdir/v1", chain(st.layers), wd)
	if bd.cachedStep(st, key) {
		return true, nil
	}
	l, ok, err := bd.mkdirLayer(ctx, st, wd)
	if err != nil {
		return false, err
	}
	bd.addResult(st, key, l, ok)
	return false, nil
}
