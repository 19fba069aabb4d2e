"""lrjax.custom_calls.triton"""
