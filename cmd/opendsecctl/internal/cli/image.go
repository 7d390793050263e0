package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/progressbar"
	opendsec "github.com/kernflux/opendsec/sdk/go"
)

// imageCommand is `opendsecctl image ...`: the shared image store.
func (a *app) imageCommand() *cobra.Command {
	c := &cobra.Command{Use: "image", Aliases: []string{"images"}, Short: "Build, import, list, inspect, tag, compose, remove and garbage-collect images"}
	c.AddCommand(a.imageImportCommand(), a.imageListCommand(), a.imageInspectCommand(), a.imageTagCommand(),
		a.imageRemoveCommand(), a.imageGCCommand(), a.imageComposeCommand(), a.imageVerifyCommand(), a.imageBuildCommand())
	return c
}

func (a *app) imageImportCommand() *cobra.Command {
	var opts opendsec.ImportOptions
	var quiet bool
	c := &cobra.Command{
		Use:   "import REF",
		Short: "Import an image from an OCI or Docker registry (linux/amd64)",
		Example: `  opendsecctl image import registry.example:5000/team/app:v1
  opendsecctl image import localhost:5000/py:3.11 --name root/py:3.11 --merge-layers`,
		Args: exactArgs(1, "REF"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			if !quiet {
				opts.Progress = importBar(a.stderr, "pulling "+args[0])
			}
			img, err := c.ImportImage(cmd.Context(), args[0], &opts)
			if opts.Progress != nil {
				fmt.Fprintln(a.stderr)
			}
			if err != nil {
				return err
			}
			return a.printImages([]*opendsec.Image{img})
		},
	}
	c.Flags().StringVar(&opts.Name, "name", "", "store the image under this name (default: the repository and tag of REF)")
	c.Flags().BoolVar(&opts.MergeLayers, "merge-layers", false, "merge runs of small consecutive layers into one")
	c.Flags().BoolVar(&opts.Insecure, "insecure", false, "use plain HTTP to a registry that is not on loopback")
	c.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress bar")
	return c
}

func (a *app) imageBuildCommand() *cobra.Command {
	var (
		opts      opendsec.BuildOptions
		tag       string
		buildArgs []string
		timeout   time.Duration
		quiet     bool
	)
	c := &cobra.Command{
		Use:   "build -t NAME[:TAG] [-f Dockerfile] DIR",
		Short: "Build an image from a Dockerfile; DIR is the build context (uploaded to a node)",
		Example: `  opendsecctl image build -t team/app:v1 .
  opendsecctl image build -f docker/Dockerfile.gpu -t team/app:gpu --build-arg VERSION=2 --timeout 20m ./src`,
		Args: exactArgs(1, "DIR"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if tag == "" {
				return fmt.Errorf("-t/--tag: give the image's name, e.g. -t team/app:v1")
			}
			opts.ContextDir = args[0]
			opts.Timeout = timeout
			opts.BuildArgs = map[string]string{}
			for _, kv := range buildArgs {
				k, v, ok := strings.Cut(kv, "=")
				if !ok || k == "" {
					return fmt.Errorf("--build-arg %q: write it as NAME=value", kv)
				}
				opts.BuildArgs[k] = v
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			if !quiet {
				opts.Progress = buildProgress(a.stderr)
			}
			img, err := c.BuildImage(cmd.Context(), tag, &opts)
			if err != nil {
				return err
			}
			return a.printImages([]*opendsec.Image{img})
		},
	}
	c.Flags().StringVarP(&tag, "tag", "t", "", "name of the image to build (NAME[:TAG])")
	c.Flags().StringVarP(&opts.DockerfilePath, "file", "f", "", "the Dockerfile (default: DIR/Dockerfile)")
	c.Flags().StringArrayVar(&buildArgs, "build-arg", nil, "NAME=value for an ARG (repeatable)")
	c.Flags().StringVar(&opts.Target, "target", "", "build this stage (default: the last)")
	c.Flags().BoolVar(&opts.NoCache, "no-cache", false, "run every step even when the build cache has it")
	c.Flags().DurationVar(&timeout, "timeout", 0, "bound the whole build (default: the node's node.build.timeout_sec)")
	c.Flags().StringVar(&opts.StartCmd, "start-cmd", "", "command a sandbox of the image runs at start (kept in the image)")
	c.Flags().StringVar(&opts.ReadyCmd, "ready-cmd", "", "command that exits 0 once the start command is ready (kept in the image)")
	c.Flags().BoolVarP(&quiet, "quiet", "q", false, "no step lines and no output of RUN steps")
	return c
}

// buildProgress prints a progress line for each step of a build as it
// ends, and the output of RUN steps, indented, under a line naming the
// running step.
func buildProgress(w io.Writer) func(*opendsec.BuildEvent) {
	var running *opendsec.BuildStep // started, no line printed yet
	atLineStart := true
	endLine := func() {
		if !atLineStart {
			fmt.Fprintln(w)
			atLineStart = true
		}
	}
	return func(e *opendsec.BuildEvent) {
		if s := e.GetStep(); s != nil {
			if !s.GetDone() {
				running = s
				return
			}
			endLine()
			running = nil
			text := s.GetInstruction()
			if s.GetCached() {
				text += " (cached)"
			} else if d := time.Duration(s.GetDurationMs()) * time.Millisecond; d >= time.Millisecond {
				text += fmt.Sprintf(" (%s)", d.Round(time.Millisecond))
			}
			fmt.Fprintln(w, progressbar.Step(int(s.GetIndex()), int(s.GetTotal()), text))
			return
		}
		l := e.GetLog()
		if l == nil {
			return
		}
		if running != nil {
			fmt.Fprintln(w, progressbar.Step(int(running.GetIndex())-1, int(running.GetTotal()), running.GetInstruction()))
			running = nil
		}
		for _, line := range strings.SplitAfter(string(l.GetData()), "\n") {
			if line == "" {
				continue
			}
			if atLineStart {
				fmt.Fprint(w, "    | ")
			}
			fmt.Fprint(w, line)
			atLineStart = strings.HasSuffix(line, "\n")
		}
	}
}

// importBar draws a one-line progress bar on w (like `opendsec image import`).
func importBar(w io.Writer, label string) func(*opendsec.ImportProgress) {
	var last time.Time
	return func(p *opendsec.ImportProgress) {
		if time.Since(last) < 100*time.Millisecond {
			return
		}
		last = time.Now()
		frac := 0.0
		if p.GetTotalBytes() > 0 {
			frac = min(1, float64(p.GetBytes())/float64(p.GetTotalBytes()))
		}
		fmt.Fprint(w, progressbar.Line(label, frac, p.GetBytes(), p.GetFiles()))
	}
}

func (a *app) printImages(imgs []*opendsec.Image) error {
	if a.output == "json" {
		for _, im := range imgs {
			if err := printJSON(a.stdout, im); err != nil {
				return err
			}
		}
		return nil
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tID\tLAYERS\tSIZE\tCREATED\tSOURCE")
	for _, im := range imgs {
		id := strings.TrimPrefix(im.GetId(), "sha256:")
		if len(id) > 12 {
			id = id[:12]
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", im.GetName(), id, len(im.GetLayers()), progressbar.Bytes(im.GetSize()), fmtTime(im.GetCreated()), orDash(im.GetSource()))
	}
	return tw.Flush()
}

func (a *app) imageListCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List images",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			imgs, err := c.ListImages(cmd.Context())
			if err != nil {
				return err
			}
			return a.printImages(imgs)
		},
	}
}

func (a *app) imageInspectCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect NAME...",
		Short: "Show images' layers, config and source (JSON)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("image inspect: give at least one image name")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			for _, n := range args {
				im, err := c.GetImage(cmd.Context(), n)
				if err != nil {
					return err
				}
				if err := printJSON(a.stdout, im); err != nil {
					return err
				}
			}
			return nil
		},
	}
}

func (a *app) imageTagCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "tag SOURCE TARGET",
		Short:   "Give an image another name (no layer is copied)",
		Example: `  opendsecctl image tag team/env:v1 team/env:stable`,
		Args:    exactArgs(2, "SOURCE TARGET"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			im, err := c.TagImage(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			return a.printImages([]*opendsec.Image{im})
		},
	}
}

func (a *app) imageRemoveCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME...",
		Aliases: []string{"remove"},
		Short:   "Remove image names (layers stay until gc; running sandboxes keep theirs)",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("image rm: give at least one image name")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			for _, n := range args {
				if err := c.RemoveImage(cmd.Context(), n); err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, n)
			}
			return nil
		},
	}
}

func (a *app) imageGCCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "gc",
		Short: "Remove layers no image names and no sandbox uses",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			res, err := c.GarbageCollectImages(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == "json" {
				return printJSON(a.stdout, res)
			}
			for _, d := range res.GetRemovedLayers() {
				fmt.Fprintln(a.stdout, d)
			}
			fmt.Fprintf(a.stderr, "removed %d layers, %s\n", len(res.GetRemovedLayers()), progressbar.Bytes(res.GetRemovedBytes()))
			return nil
		},
	}
}

func (a *app) imageVerifyCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "verify",
		Short: "Re-hash every layer against its digest",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			res, err := c.VerifyImages(cmd.Context())
			if err != nil {
				return err
			}
			if a.output == "json" {
				if err := printJSON(a.stdout, res); err != nil {
					return err
				}
			} else {
				for _, cl := range res.GetCorrupt() {
					fmt.Fprintf(a.stdout, "%s\t%s\n", cl.GetDigest(), cl.GetReason())
				}
				fmt.Fprintf(a.stderr, "checked %d layers, %d damaged\n", res.GetChecked(), len(res.GetCorrupt()))
			}
			if len(res.GetCorrupt()) > 0 {
				return &exitError{code: 1}
			}
			return nil
		},
	}
}

func (a *app) imageComposeCommand() *cobra.Command {
	var req opendsec.ComposeRequest
	var env []string
	var workdir string
	c := &cobra.Command{
		Use:   "compose BASE NAME",
		Short: "Make an image from BASE plus extra layers, without copying layers",
		Example: `  opendsecctl image compose root/py:3.11 team/env:v1 --image team/workspace:v3 --layer sha256:4f...
  opendsecctl image compose team/env:v1 team/env:v1-flat --merge-layers`,
		Args: exactArgs(2, "BASE NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.Base, req.Name = args[0], args[1]
			if len(env) > 0 || workdir != "" {
				req.Config = &opendsec.ImageConfig{Env: env, Workdir: workdir}
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			im, err := c.ComposeImage(cmd.Context(), req)
			if err != nil {
				return err
			}
			return a.printImages([]*opendsec.Image{im})
		},
	}
	c.Flags().StringArrayVar(&req.LayerDigests, "layer", nil, "a layer digest (sha256:...) to stack on BASE (repeatable, in order)")
	c.Flags().StringArrayVar(&req.Images, "image", nil, "stack this image's layers that BASE lacks (repeatable, after --layer ones)")
	c.Flags().StringArrayVar(&env, "env", nil, "set K=V in the image's environment (repeatable)")
	c.Flags().StringVar(&workdir, "workdir", "", "the image's working directory")
	c.Flags().BoolVar(&req.MergeLayers, "merge-layers", false, "merge runs of small consecutive layers into one new layer")
	return c
}

// packDiffCommand is `opendsecctl sandbox pack-diff ID NAME`.
func (a *app) packDiffCommand() *cobra.Command {
	var scrub []string
	c := &cobra.Command{
		Use:   "pack-diff ID NAME",
		Short: "Save a sandbox's changes as a new image on top of its image",
		Example: `  opendsecctl sandbox pack-diff n001sb0001 team/env:with-deps --scrub /root/.cache --scrub /tmp
  opendsecctl sandbox create --image team/env:with-deps`,
		Args: exactArgs(2, "ID NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			im, err := c.PackDiff(cmd.Context(), args[0], args[1], scrub...)
			if err != nil {
				return err
			}
			return a.printImages([]*opendsec.Image{im})
		},
	}
	c.Flags().StringArrayVar(&scrub, "scrub", nil, "absolute path to leave out of the new layer (repeatable)")
	return c
}
