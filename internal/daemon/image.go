package daemon

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/progressbar"
)

func imageCommand(g *globalFlags) *cobra.Command {
	c := &cobra.Command{Use: "image", Short: "manage the node's image store"}
	var env []string
	var cfg image.Config
	var quiet bool
	addCfg := func(cmd *cobra.Command) {
		cmd.Flags().StringArrayVar(&env, "env", nil, "image environment K=V (repeatable)")
		cmd.Flags().StringVar(&cfg.Workdir, "workdir", "", "default working directory")
		cmd.Flags().StringVar(&cfg.User, "user", "", "default user")
		cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress bar")
	}
	importFn := func(kind string) func(cmd *cobra.Command, args []string) error {
		return func(cmd *cobra.Command, args []string) error {
			name, _ := cmd.Flags().GetString("name")
			src, _ := cmd.Flags().GetString(kind)
			if name == "" {
				return fmt.Errorf("--name: is empty; give an image name, e.g. root/py:3.11")
			}
			if src == "" {
				return fmt.Errorf("--%s: is empty; give the path to import", kind)
			}
			st, err := g.imageStore()
			if err != nil {
				return err
			}
			cfg.Env = env
			var opts []image.ImportOption
			if !quiet {
				opts = append(opts, image.WithProgress(progressBar(cmd.ErrOrStderr(), "importing "+name)))
			}
			var img image.Image
			if kind == "rootfs" {
				img, err = st.ImportDir(cmd.Context(), name, src, cfg, opts...)
			} else {
				img, err = st.ImportTar(cmd.Context(), name, src, cfg, opts...)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s\t%s\t%s\n", img.Name, img.ID, progressbar.Bytes(img.Size))
			return nil
		}
	}
	rootfs := &cobra.Command{Use: "import-rootfs", Short: "import a root filesystem directory", Args: cobra.NoArgs, RunE: importFn("rootfs")}
	rootfs.Flags().String("name", "", "image name, e.g. root/py:3.11")
	rootfs.Flags().String("rootfs", "", "root filesystem directory")
	addCfg(rootfs)
	tarball := &cobra.Command{Use: "import-tar", Short: "import a root filesystem tarball (plain or gzip)", Args: cobra.NoArgs, RunE: importFn("tar")}
	tarball.Flags().String("name", "", "image name")
	tarball.Flags().String("tar", "", "tarball path")
	addCfg(tarball)

	var output string
	list := &cobra.Command{
		Use: "list", Short: "list images", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := g.imageStore()
			if err != nil {
				return err
			}
			imgs, err := st.List(cmd.Context())
			if err != nil {
				return err
			}
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(imgs)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tID\tSIZE\tCREATED")
			for _, i := range imgs {
				id := i.ID
				if len(id) > 19 {
					id = id[:19]
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", i.Name, id, progressbar.Bytes(i.Size), i.Created.Format(time.RFC3339))
			}
			return tw.Flush()
		},
	}
	list.Flags().StringVarP(&output, "output", "o", "table", "table or json")
	rm := &cobra.Command{
		Use: "rm NAME...", Short: "remove images (running sandboxes keep their copy)", Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := g.imageStore()
			if err != nil {
				return err
			}
			for _, n := range args {
				if err := st.Remove(cmd.Context(), n); err != nil {
					return err
				}
			}
			return nil
		},
	}
	c.AddCommand(rootfs, tarball, list, rm)
	c.AddCommand(imageImportCommand(g), imageInspectCommand(g)) // image_oci.go
	return c
}

// progressBar returns a callback drawing a one-line progress bar on w.
func progressBar(w io.Writer, label string) func(image.Progress) {
	last := time.Time{}
	return func(p image.Progress) {
		if !p.Done && time.Since(last) < 100*time.Millisecond {
			return
		}
		last = time.Now()
		frac := 0.0
		if p.TotalBytes > 0 {
			frac = float64(p.Bytes) / float64(p.TotalBytes)
		}
		if p.Done {
			frac = 1
		}
		fmt.Fprint(w, progressbar.Line(label, frac, p.Bytes, p.Files))
		if p.Done {
			fmt.Fprintln(w)
		}
	}
}

// imageStore loads the configuration and opens the node's image store.
func (g *globalFlags) imageStore() (*image.Store, error) {
	conf, err := g.load()
	if err != nil {
		return nil, err
	}
	return image.Open(conf.Node.ImageDir)
}
