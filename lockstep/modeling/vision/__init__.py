"""Vision-language models: the frozen vision tower and its merger, the image processing the
engines run, M-RoPE's 3-D positions, and the tiny random VLMs the tests build offline."""
