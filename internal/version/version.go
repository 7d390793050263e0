// Package version holds the build's version, set with -ldflags.
package version

// Version is the build's version (git describe), "dev" when unset.
var Version = "dev"
