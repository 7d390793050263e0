package daemon

import (
	"encoding/json"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/kernflux/opendsec/internal/image"
	"github.com/kernflux/opendsec/internal/progressbar"
)

// imageImportCommand is `opendsec image import REF`: pull from a registry.
func imageImportCommand(g *globalFlags) *cobra.Command {
	var storeName string
	var quiet bool
	c := &cobra.Command{
		Use:   "import REF",
		Short: "import an image from an OCI or Docker registry, an OCI layout or a docker save tarball (linux/amd64)",
		Long: "Import stores the image REF in the image store as layers. REF is one of:\n" +
			"  REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]   pull from a registry (credentials from ~/.docker/config.json)\n" +
			"  oci-layout:PATH[:TAG|@sha256:DIGEST]       an OCI image layout directory (TAG is its ref.name annotation)\n" +
			"  docker-archive:PATH[:REF]                  a `docker save` tarball (REF picks one of several images)\n" +
			"Layers already in the store are not read again. Every digest the source records is checked.",
		Example: "  opendsec image import registry.example:5000/team/app:v1\n" +
			"  opendsec image import oci-layout:/srv/layouts/app:v1 --name team/app:v1\n" +
			"  opendsec image import docker-archive:/tmp/app.tar:team/app:v1",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := g.imageStore()
			if err != nil {
				return err
			}
			var opts []image.ImportOption
			if storeName != "" {
				opts = append(opts, image.WithName(storeName))
			}
			if !quiet {
				opts = append(opts, image.WithProgress(progressBar(cmd.ErrOrStderr(), "pulling "+args[0])))
			}
			img, err := st.Import(cmd.Context(), args[0], opts...)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s\t%s\t%d layers\t%s\n", img.Name, img.ID, len(img.Layers), progressbar.Bytes(img.Size))
			return nil
		},
	}
	c.Flags().StringVar(&storeName, "name", "", "store the image under this name (default: the repository and tag of REF, or the archive's tag)")
	c.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress bar")
	return c
}

// imageInspectCommand is `opendsec image inspect NAME...`: print as JSON.
func imageInspectCommand(g *globalFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect NAME...",
		Short: "show images' layers, config and source as JSON",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := g.imageStore()
			if err != nil {
				return err
			}
			var out []image.Image
			for _, n := range args {
				img, err := st.Inspect(cmd.Context(), n)
				if err != nil {
					return err
				}
				out = append(out, img)
			}
			enc := json.NewEncoder(cmd.OutOrStdout())
			enc.SetIndent("", "  ")
			return enc.Encode(out)
		},
	}
}
