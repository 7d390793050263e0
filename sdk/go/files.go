package opendsec

import (
	"context"
	"errors"
	"fmt"
	"io"

	"connectrpc.com/connect"

	opendsecv1 "github.com/kernflux/opendsec/api/gen/opendsec/v1"
)

// ChunkSize is the size of the data messages WriteFile sends.
const ChunkSize = 1 << 20

// File types reported in FileInfo.Type.
const (
	FileTypeFile      = opendsecv1.FileType_FILE_TYPE_FILE
	FileTypeDirectory = opendsecv1.FileType_FILE_TYPE_DIRECTORY
	FileTypeSymlink   = opendsecv1.FileType_FILE_TYPE_SYMLINK
)

// ReadFile copies the file at path in sandbox id to w and returns the number
// of bytes written.
func (c *Client) ReadFile(ctx context.Context, id, path string, w io.Writer) (int64, error) {
	if path == "" {
		return 0, invalid("path", "must not be empty")
	}
	stream, err := c.files.ReadFile(ctx, connect.NewRequest(&opendsecv1.ReadFileRequest{SandboxId: id, Path: path}))
	if err != nil {
		return 0, convertError(err)
	}
	defer stream.Close()
	var n int64
	for stream.Receive() {
		m, err := w.Write(stream.Msg().GetData())
		n += int64(m)
		if err != nil {
			return n, fmt.Errorf("write local copy of %s: %w", path, err)
		}
	}
	return n, convertError(stream.Err())
}

// WriteFile replaces the file at path in sandbox id with the contents of r,
// sent in ChunkSize pieces. size is the total length if known (the server
// rejects too large uploads before any data is sent), or -1.
func (c *Client) WriteFile(ctx context.Context, id, path string, r io.Reader, size int64) (*FileInfo, error) {
	if path == "" {
		return nil, invalid("path", "must not be empty")
	}
	if size < 0 {
		size = 0
	}
	stream := c.files.WriteFile(ctx)
	hdr := &opendsecv1.WriteFileRequest{Msg: &opendsecv1.WriteFileRequest_Header{Header: &opendsecv1.WriteFileHeader{
		SandboxId: id, Path: path, Size: size,
	}}}
	// On io.EOF from Send the server has answered; CloseAndReceive has why.
	finish := func() (*FileInfo, error) {
		resp, err := stream.CloseAndReceive()
		if err != nil {
			return nil, convertError(err)
		}
		return resp.Msg.GetFile(), nil
	}
	if err := stream.Send(hdr); err != nil {
		if isEOF(err) {
			return finish()
		}
		_, _ = stream.CloseAndReceive()
		return nil, convertError(err)
	}
	buf := make([]byte, ChunkSize)
	for {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			// Send marshals before returning, so buf may be reused.
			err := stream.Send(&opendsecv1.WriteFileRequest{Msg: &opendsecv1.WriteFileRequest_Data{Data: buf[:n]}})
			if err != nil {
				if isEOF(err) {
					return finish()
				}
				_, _ = stream.CloseAndReceive()
				return nil, convertError(err)
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			_, _ = stream.CloseAndReceive()
			return nil, fmt.Errorf("read local data for %s: %w", path, rerr)
		}
	}
	return finish()
}

// ListDir lists the directory at path in sandbox id, descending depth levels
// (0 means 1).
func (c *Client) ListDir(ctx context.Context, id, path string, depth int) ([]*FileInfo, error) {
	if depth < 0 {
		return nil, invalid("depth", "must not be negative")
	}
	resp, err := c.files.ListDir(ctx, connect.NewRequest(&opendsecv1.ListDirRequest{SandboxId: id, Path: path, Depth: uint32(depth)}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetEntries(), nil
}

// Stat describes the file at path in sandbox id.
func (c *Client) Stat(ctx context.Context, id, path string) (*FileInfo, error) {
	resp, err := c.files.Stat(ctx, connect.NewRequest(&opendsecv1.StatRequest{SandboxId: id, Path: path}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetFile(), nil
}

// Remove deletes the file or directory (with its contents) at path.
func (c *Client) Remove(ctx context.Context, id, path string) error {
	_, err := c.files.Remove(ctx, connect.NewRequest(&opendsecv1.RemoveRequest{SandboxId: id, Path: path}))
	return convertError(err)
}

// MakeDir creates the directory at path with its parents. created is false
// when it already existed.
func (c *Client) MakeDir(ctx context.Context, id, path string) (info *FileInfo, created bool, err error) {
	resp, err := c.files.MakeDir(ctx, connect.NewRequest(&opendsecv1.MakeDirRequest{SandboxId: id, Path: path}))
	if err != nil {
		return nil, false, convertError(err)
	}
	return resp.Msg.GetFile(), resp.Msg.GetCreated(), nil
}

// Move renames source to destination inside sandbox id.
func (c *Client) Move(ctx context.Context, id, source, destination string) (*FileInfo, error) {
	resp, err := c.files.Move(ctx, connect.NewRequest(&opendsecv1.MoveRequest{SandboxId: id, Source: source, Destination: destination}))
	if err != nil {
		return nil, convertError(err)
	}
	return resp.Msg.GetFile(), nil
}
