raise ImportError("this test package never imports")
